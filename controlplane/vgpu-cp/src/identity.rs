//! `DATA_DIR/identity.json`: which cluster and which member a data directory belongs to, and how
//! the member came to it (it bootstrapped the cluster or joined it). It is written once, when the
//! directory is first used, and checked on every start, so a data directory is never reused by
//! another member id, joined to another cluster, or taken by `bootstrap` for a new cluster while
//! it holds a member that joined another one.

use serde::{Deserialize, Serialize};
use std::path::Path;

const FILE: &str = "identity.json";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub cluster_id: String,
    pub node_id: u64,
    /// How the member entered its cluster; `None` in files written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
}

/// How a data directory's member entered its cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Origin {
    /// It created the cluster (`vgpu-cp bootstrap`, or member 1 under `mode = "auto"`).
    Bootstrap,
    /// It joined the cluster through its peers.
    Join,
}

pub fn read(directory: &Path) -> std::io::Result<Option<Identity>> {
    match std::fs::read(directory.join(FILE)) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(std::io::Error::other),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error),
    }
}

pub fn write(directory: &Path, identity: &Identity) -> std::io::Result<()> {
    let temporary = directory.join(format!("{FILE}.tmp"));
    let bytes = serde_json::to_vec_pretty(identity).map_err(std::io::Error::other)?;
    let file = std::fs::File::create(&temporary)?;
    std::io::Write::write_all(&mut &file, &bytes)?;
    file.sync_all()?;
    std::fs::rename(&temporary, directory.join(FILE))?;
    std::fs::File::open(directory)?.sync_all()?;
    assert_eq!(
        read(directory)?.as_ref(),
        Some(identity),
        "identity reads back as written"
    );
    Ok(())
}

/// A new cluster id: 16 random hex digits.
pub fn new_cluster_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_origin_is_kept_and_files_without_one_still_read() {
        let directory = tempfile::tempdir().unwrap();
        assert_eq!(read(directory.path()).unwrap(), None);
        let identity = Identity {
            cluster_id: "00000000000000aa".to_owned(),
            node_id: 2,
            origin: Some(Origin::Join),
        };
        write(directory.path(), &identity).unwrap();
        let text = std::fs::read_to_string(directory.path().join(FILE)).unwrap();
        assert!(text.contains("\"origin\": \"join\""), "{text}");
        // A file of an earlier version has no origin.
        std::fs::write(
            directory.path().join(FILE),
            r#"{ "cluster_id": "00000000000000aa", "node_id": 2 }"#,
        )
        .unwrap();
        let old = read(directory.path()).unwrap().unwrap();
        assert_eq!((old.node_id, old.origin), (2, None));
    }
}
