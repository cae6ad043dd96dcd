//! Tests of moving a pool between the stores (`transfer`): the export file's refusals, and a Raft
//! import.

use super::*;

fn pool() -> PoolState {
    let mut pool = PoolState::default();
    pool.tokens.insert("ab".repeat(32), 99);
    pool
}

fn file() -> Vec<u8> {
    encode_export(StoreKind::Raft, "00000000000000aa", 7, &pool())
}

/// The header line `name=...` of `bytes` replaced by `name=value` (the body unchanged).
fn with_field(bytes: &[u8], name: &str, value: &str) -> Vec<u8> {
    let end = bytes.windows(2).position(|pair| pair == b"\n\n").unwrap();
    let header = std::str::from_utf8(&bytes[..end]).unwrap();
    let header: Vec<String> = header
        .lines()
        .map(|line| match line.split_once('=') {
            Some((key, _)) if key == name => format!("{name}={value}"),
            _ => line.to_owned(),
        })
        .collect();
    let mut out = header.join("\n").into_bytes();
    out.extend_from_slice(&bytes[end..]);
    out
}

/// `bytes` with its checksum line made right for its header and body again (a file changed
/// by someone who also fixed the checksum, to reach the checks after it).
fn resealed(bytes: &[u8]) -> Vec<u8> {
    let end = bytes.windows(2).position(|pair| pair == b"\n\n").unwrap();
    let header = std::str::from_utf8(&bytes[..end]).unwrap();
    let covered = &header[..header.rfind("\nsha256=").unwrap() + 1];
    let body = &bytes[end + 2..];
    let mut out = format!(
        "{covered}sha256={}\n\n",
        sha256_hex(covered.as_bytes(), body)
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

fn refusal(bytes: &[u8]) -> String {
    match decode_export(Path::new("/tmp/pool.export"), bytes) {
        Ok(_) => panic!("accepted"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn an_export_reads_back_as_its_header_and_state() {
    let bytes = file();
    let text = String::from_utf8_lossy(&bytes);
    assert!(text.starts_with("vgpu-pool-export\nformat_version=1\nsource_store=raft\n"));
    let export = decode_export(Path::new("f"), &bytes).unwrap();
    assert_eq!(export.header.cluster_id, "00000000000000aa");
    assert_eq!(export.header.source_store, StoreKind::Raft);
    assert_eq!(export.header.last_applied_index, 7);
    assert_eq!(export.pool.tokens, pool().tokens);
    // Pair check: what decodes encodes to the same bytes.
    assert_eq!(
        encode_export(StoreKind::Raft, "00000000000000aa", 7, &export.pool),
        bytes
    );
}

#[test]
fn a_damaged_body_fails_the_checksum() {
    let mut bytes = file();
    *bytes.last_mut().unwrap() ^= 1;
    let message = refusal(&bytes);
    assert!(message.contains("fails its checksum"), "{message}");
    assert!(message.contains("export the pool again"), "{message}");
}

#[test]
fn a_changed_header_fails_the_checksum() {
    let message = refusal(&with_field(&file(), "cluster_id", "00000000000000bb"));
    assert!(message.contains("fails its checksum"), "{message}");
}

#[test]
fn a_cut_short_file_is_refused() {
    let bytes = file();
    let message = refusal(&bytes[..bytes.len() - 3]);
    assert!(message.contains("is damaged"), "{message}");
    assert!(message.contains("its header says"), "{message}");
}

#[test]
fn an_unknown_format_version_is_refused_by_name() {
    let message = refusal(&with_field(&file(), "format_version", "2"));
    assert!(message.contains("format 2"), "{message}");
    assert!(message.contains("reads format 1"), "{message}");
    let message = refusal(&with_field(&file(), "format_version", "x"));
    assert!(message.contains("format x"), "{message}");
}

#[test]
fn a_header_that_disagrees_with_its_body_is_refused() {
    let changed = with_field(&file(), "last_applied_index", "8");
    let message = refusal(&changed);
    assert!(message.contains("fails its checksum"), "{message}");
    let message = refusal(&resealed(&changed));
    assert!(message.contains("index 7"), "{message}");
    assert_eq!(resealed(&file()), file(), "resealing keeps a sound file");
    let message = refusal(&with_field(&file(), "source_store", "zookeeper"));
    assert!(message.contains("source_store"), "{message}");
}

#[test]
fn another_file_is_not_an_export() {
    let message = refusal(b"{\"nodes\": []}\n");
    assert!(message.contains("not a pool export"), "{message}");
    assert!(message.contains("vgpu-cp export --out"), "{message}");
}

fn config(data_dir: &Path) -> crate::Config {
    crate::Config {
        mode: crate::Mode::Bootstrap,
        id: 1,
        listen: "127.0.0.1:7401".parse().unwrap(),
        advertise: "127.0.0.1:7401".to_owned(),
        data_dir: data_dir.to_owned(),
        timings: crate::control_plane::Timings::default(),
        raft: crate::RaftTimings::default(),
        security: crate::Security::default(),
        etcd: None,
    }
}

#[tokio::test]
async fn import_refuses_a_data_dir_that_is_not_empty_and_writes_nothing_there() {
    let dir = tempfile::tempdir().unwrap();
    let export = dir.path().join("pool.export");
    std::fs::write(&export, file()).unwrap();
    let data_dir = dir.path().join("member");
    std::fs::create_dir(&data_dir).unwrap();
    std::fs::write(data_dir.join("raft.redb"), b"old").unwrap();
    let error = import(&config(&data_dir), &export).await.unwrap_err();
    assert!(
        matches!(error, TransferError::DataDirNotEmpty { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("empty --data-dir"), "{error}");
    assert_eq!(std::fs::read_dir(&data_dir).unwrap().count(), 1);
}

#[tokio::test]
async fn a_raft_import_leaves_a_first_snapshot_and_the_kept_cluster_id() {
    let dir = tempfile::tempdir().unwrap();
    let export = dir.path().join("pool.export");
    std::fs::write(&export, file()).unwrap();
    let data_dir = dir.path().join("member");
    let summary = import(&config(&data_dir), &export).await.unwrap();
    assert_eq!(summary.header.last_applied_index, 7);
    let identity = identity::read(&data_dir).unwrap().unwrap();
    assert_eq!(identity.cluster_id, "00000000000000aa");
    assert_eq!(identity.origin, Some(identity::Origin::Bootstrap));
    let (_, shared) = store::StateMachineStore::open(&data_dir).unwrap();
    let applied = shared.read();
    assert_eq!(applied.last_applied.map(|id| id.index), Some(7));
    assert_eq!(applied.pool.tokens, pool().tokens);
    let voters: Vec<u64> = applied.membership.voter_ids().collect();
    assert_eq!(voters, [1]);
}
