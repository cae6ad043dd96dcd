//! Cross-component tests with real processes: `vgpu-cp` members, `vgpu-agent`s with simulated
//! GPUs and `vgpuctl`, on loopback. Files are numbered by layer.

mod t00_tidy;
mod t10_pool;
mod t20_bad_input;
mod t21_dashboard;
mod t22_node_identity;
mod t22_owner_priority;
mod t22_round_two;
mod t30_cluster;
mod t32_whole_node;
mod t40_agent_loss;
mod t50_security;
mod t60_usage;
mod t70_fleet;
mod t80_nccl_env;
mod t85_tenant_settings;
mod t90_kubernetes;
mod t91_dra_control_plane;
