//! etcd-store against real etcd members on loopback (`etcd_cluster`): one binary, a file per
//! area. Every wait is bounded; each test takes seconds.

mod etcd_cluster;
mod t10_log;
mod t20_follower;
mod t30_election;
mod t40_quorum;
mod t50_tls;
mod t60_applier;
mod t70_presence;
