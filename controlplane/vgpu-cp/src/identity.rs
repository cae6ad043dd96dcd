//! `DATA_DIR/identity.json`: which cluster and which member a data directory belongs to. It is
//! written once, when the directory is first used, and checked on every start, so a data directory
//! is never reused by another member id or joined to another cluster by mistake.

use serde::{Deserialize, Serialize};
use std::path::Path;

const FILE: &str = "identity.json";

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub cluster_id: String,
    pub node_id: u64,
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
