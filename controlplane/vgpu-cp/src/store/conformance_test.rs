//! Runs openraft's storage conformance suite against our log store and state machine.

use super::{LogStore, StateMachineStore, WriteMode};
use crate::raft_types::{StorageError, TypeConfig};
use openraft::testing::{StoreBuilder, Suite};

struct Builder(WriteMode);

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, tempfile::TempDir> for Builder {
    async fn build(
        &self,
    ) -> Result<(tempfile::TempDir, LogStore, StateMachineStore), StorageError> {
        let directory = tempfile::tempdir().expect("a temporary directory");
        let log =
            LogStore::open_with(&directory.path().join("raft.redb"), self.0).expect("open the log");
        let (state_machine, _) = StateMachineStore::open(directory.path())?;
        Ok((directory, log, state_machine))
    }
}

#[test]
fn openraft_storage_conformance_suite_group_commit() -> Result<(), StorageError> {
    Suite::test_all(Builder(WriteMode::GroupCommit))?;
    Ok(())
}

#[test]
fn openraft_storage_conformance_suite_inline() -> Result<(), StorageError> {
    Suite::test_all(Builder(WriteMode::Inline))?;
    Ok(())
}
