//! `vgpuctl describe`: one tenant or node in detail, as aligned `Key: value` text for people.
//! Scripts should use `vgpuctl get ... -o json` instead; this text may change.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use api::size::format_bytes;

use crate::output::{NONE, Table, age, format_latency, format_milli, or_none, timestamp, yes_no};
use crate::views::{HealthView, NodeView, ProcessView, SliceView, TenantView, UsageView};

/// Width of the key column, so values line up.
const KEY_WIDTH: usize = 18;

/// Appends `key: value` with the value aligned, at `indent` spaces.
fn field(text: &mut String, indent: usize, key: &str, value: impl std::fmt::Display) {
    let key = format!("{key}:");
    // At least one space between key and value, however long the key.
    let width = KEY_WIDTH.saturating_sub(indent).max(key.len() + 1);
    writeln!(text, "{:indent$}{key:<width$}{value}", "").expect("writing to a String");
}

/// Appends a block (a table or a list) indented by `indent` spaces.
fn block(text: &mut String, indent: usize, body: &str) {
    for line in body.lines() {
        writeln!(text, "{:indent$}{line}", "").expect("writing to a String");
    }
}

fn pairs(map: &BTreeMap<String, String>) -> String {
    if map.is_empty() {
        return "<none>".into();
    }
    map.iter()
        .map(|(key, value)| format!("{key}={value}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// `describe tenant NAME`; `now_unix_ms` dates the usage reports.
pub fn tenant_text(tenant: &TenantView, now_unix_ms: i64) -> String {
    let mut text = String::new();
    field(&mut text, 0, "Name", &tenant.name);
    field(&mut text, 0, "State", &tenant.state);
    field(&mut text, 0, "Reason", or_none(tenant.reason.clone()));
    field(&mut text, 0, "Created", timestamp(tenant.created_unix_ms));
    field(&mut text, 0, "Revision", tenant.revision);
    if !tenant.owner.is_empty() {
        field(&mut text, 0, "Owner", &tenant.owner);
    }

    let request = &tenant.request;
    text.push_str("Request:\n");
    let gpus = if request.milli_gpus > 0 {
        format!("{} of one GPU", format_milli(request.milli_gpus))
    } else if request.nodes > 1 {
        format!("{} per node on {} nodes", request.whole_gpus, request.nodes)
    } else {
        request.whole_gpus.to_string()
    };
    field(&mut text, 2, "GPUs", gpus);
    let memory = match request.memory_bytes_per_gpu {
        0 => "default (the GPU's share)".to_owned(),
        bytes => format_bytes(bytes),
    };
    field(&mut text, 2, "Memory/GPU", memory);
    if request.memory_limit_bytes_per_gpu > request.memory_bytes_per_gpu {
        field(
            &mut text,
            2,
            "Memory limit/GPU",
            format!(
                "{} (borrowed above the request when the GPU has it free)",
                format_bytes(request.memory_limit_bytes_per_gpu)
            ),
        );
    }
    let compute = match request.compute_percent {
        0 => "default (the GPU's share)".to_owned(),
        percent => format!("{percent}%"),
    };
    field(&mut text, 2, "Compute/GPU", compute);
    field(&mut text, 2, "Burst", yes_no(request.burst));
    field(&mut text, 2, "Priority", request.priority);
    field(&mut text, 2, "Preemptible", yes_no(request.preemptible));
    field(&mut text, 2, "NVLink", &request.nvlink);
    field(&mut text, 2, "Node selector", pairs(&request.node_selector));
    let bandwidth = match request.bandwidth_weight {
        0 => "default (the compute share)".to_owned(),
        weight => weight.to_string(),
    };
    field(&mut text, 2, "Bandwidth weight", bandwidth);
    field(&mut text, 2, "Latency", yes_no(request.latency));
    if request.latency {
        let target = match request.latency_target_us {
            0 => "default (1.2x its latency alone)".to_owned(),
            microseconds => format_latency(microseconds),
        };
        field(&mut text, 2, "Latency target", target);
    }
    let cpu = match request.cpu_milli {
        0 => "<none>".to_owned(),
        milli => format!("{} per node", api::cpu::format_cpu_milli(milli)),
    };
    field(&mut text, 2, "CPU", cpu);
    let host_memory = match request.host_memory_bytes {
        0 => "<none>".to_owned(),
        bytes => format!("{} per node", format_bytes(bytes)),
    };
    field(&mut text, 2, "Host memory", host_memory);
    let models = if request.gpu_models.is_empty() {
        "any".to_owned()
    } else {
        request.gpu_models.join(", ")
    };
    field(&mut text, 2, "GPU models", models);

    text.push_str("Placement:\n");
    if tenant.slices.is_empty() {
        block(&mut text, 2, "<none>");
    } else {
        block(&mut text, 2, &slices_table(&tenant.slices).render());
    }

    if !tenant.slices.is_empty() {
        text.push_str("Usage:\n");
        if tenant.usage.is_empty() {
            block(&mut text, 2, "<none reported yet>");
        } else {
            block(
                &mut text,
                2,
                &usage_table(&tenant.usage, now_unix_ms).render(),
            );
        }
    }

    if tenant.usage.iter().any(UsageView::has_board) {
        text.push_str("Elastic memory:\n");
        block(
            &mut text,
            2,
            &elastic_memory_table(&tenant.usage, now_unix_ms).render(),
        );
    }

    if tenant.usage.iter().any(UsageView::has_latency) {
        text.push_str("Latency:\n");
        block(&mut text, 2, &latency_table(&tenant.usage).render());
    }

    if tenant.usage.iter().any(UsageView::is_redistributed) {
        text.push_str("SM redistribution:\n");
        block(&mut text, 2, &redistribution_table(&tenant.usage).render());
    }

    text.push_str("History:\n");
    if tenant.history.is_empty() {
        block(&mut text, 2, "<none>");
    } else {
        let mut table = Table::new(&["TIME", "STATE", "MESSAGE"]);
        for event in &tenant.history {
            table.row(vec![
                timestamp(event.unix_ms),
                event.state.clone(),
                or_none(event.message.clone()),
            ]);
        }
        block(&mut text, 2, &table.render());
    }
    text
}

/// GPU time as seconds with one decimal (`12.3s`).
pub fn gpu_time(ns: u64) -> String {
    format!("{:.1}s", ns as f64 / 1e9)
}

fn processes_text(processes: &[ProcessView], with_tenant: bool) -> String {
    if processes.is_empty() {
        return NONE.into();
    }
    processes
        .iter()
        .map(|p| {
            let owner = if with_tenant && !p.tenant.is_empty() {
                format!(" {}", p.tenant)
            } else {
                String::new()
            };
            format!("{}{owner} {}", p.pid, format_bytes(p.memory_bytes))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn usage_table(usage: &[UsageView], now_unix_ms: i64) -> Table {
    let mut table = Table::new(&[
        "NODE",
        "GPU",
        "MEMORY USED/LIMIT",
        "GPU TIME",
        "PROCS",
        "PIDS",
        "REPORTED",
    ]);
    for entry in usage {
        // The ledger's limit is the request; a tenant that may borrow above it (a memory limit
        // on the GPU's board) may use up to the board's limit: "36GiB/16GiB" read as a broken
        // quota.
        let borrowable = if entry.has_board() {
            entry.memory_board_limit_bytes
        } else {
            0
        };
        let limit = match entry.memory_limit_bytes {
            0 => "unlimited".to_owned(),
            bytes => format_bytes(bytes.max(borrowable)),
        };
        table.row(vec![
            entry.node.clone(),
            entry.gpu_index.to_string(),
            format!("{}/{limit}", format_bytes(entry.memory_used_bytes)),
            gpu_time(entry.gpu_time_ns),
            entry.process_count.to_string(),
            processes_text(&entry.processes, false),
            age(entry.reported_unix_ms, now_unix_ms),
        ]);
    }
    table
}

/// The GPUs' memory boards for the tenant (entries with board figures): its request and limit,
/// what it holds resident, what of that it borrowed above the request, what it swapped out, the
/// pinned host staging that holds it, and its reclaim history (times it gave memory back, the
/// bytes, and when last).
fn elastic_memory_table(usage: &[UsageView], now_unix_ms: i64) -> Table {
    let mut table = Table::new(&[
        "NODE", "GPU", "REQUEST", "LIMIT", "RESIDENT", "BORROWED", "SWAPPED", "STAGING",
        "RECLAIMS", "WAITING",
    ]);
    for entry in usage.iter().filter(|entry| entry.has_board()) {
        table.row(vec![
            entry.node.clone(),
            entry.gpu_index.to_string(),
            format_bytes(entry.memory_request_bytes),
            format_bytes(entry.memory_board_limit_bytes),
            format_bytes(entry.memory_resident_bytes),
            format_bytes(entry.memory_borrowed_bytes),
            format_bytes(entry.memory_swapped_bytes),
            format_bytes(entry.memory_staging_bytes),
            match entry.memory_reclaims {
                0 => NONE.to_owned(),
                times => format!(
                    "{times} ({}), last {}",
                    format_bytes(entry.memory_reclaimed_bytes),
                    age(entry.memory_last_reclaim_unix_ms, now_unix_ms)
                ),
            },
            match entry.memory_waiting_processes {
                0 => NONE.to_owned(),
                processes => format!(
                    "{processes} for {}",
                    format_wait(entry.memory_longest_wait_ms)
                ),
            },
        ]);
    }
    table
}

/// How long a process has waited in a GPU's line: `850ms`, `42s`, `5m12s`, `2h03m`.
fn format_wait(ms: u64) -> String {
    let seconds = ms / 1000;
    match seconds {
        0 => format!("{ms}ms"),
        1..=59 => format!("{seconds}s"),
        60..=3599 => format!("{}m{:02}s", seconds / 60, seconds % 60),
        _ => format!("{}h{:02}m", seconds / 3600, seconds % 3600 / 60),
    }
}

/// What each node's controller measured for a latency tenant (entries with latency numbers).
fn latency_table(usage: &[UsageView]) -> Table {
    let mut table = Table::new(&[
        "NODE",
        "GPU",
        "TARGET",
        "ALONE P99",
        "P50",
        "P99",
        "STEPS",
        "VIOLATIONS",
    ]);
    let measured = |microseconds: u64| match microseconds {
        0 => NONE.to_owned(),
        microseconds => format_latency(microseconds),
    };
    for entry in usage.iter().filter(|entry| entry.has_latency()) {
        table.row(vec![
            entry.node.clone(),
            entry.gpu_index.to_string(),
            measured(entry.latency_target_us),
            measured(entry.latency_baseline_us),
            measured(entry.latency_p50_us),
            measured(entry.latency_p99_us),
            entry.latency_steps.to_string(),
            entry.latency_violations.to_string(),
        ]);
    }
    table
}

/// What each MPS node's SM redistribution keeps for a best-effort tenant it follows (entries
/// with a cap): how its group shares the GPU (turns, or side by side), the share of the SMs its
/// cap leaves it, its progress at the kept caps, its
/// progress alone (the redistribution's last probe) and the share of that it makes beside the
/// others (its work, as the redistribution counts the group's: docs/design/utility-redistribution.md).
fn redistribution_table(usage: &[UsageView]) -> Table {
    let mut table = Table::new(&[
        "NODE", "GPU", "SHARING", "SM SHARE", "PROGRESS", "ALONE", "WORK",
    ]);
    for entry in usage.iter().filter(|entry| entry.is_redistributed()) {
        let work = if entry.progress_per_s > 0.0 && entry.progress_alone_per_s > 0.0 {
            format!("{:.2}", entry.progress_per_s / entry.progress_alone_per_s)
        } else {
            NONE.to_owned()
        };
        let sharing = if entry.redistribution_side_by_side {
            "side by side"
        } else {
            "turns"
        };
        table.row(vec![
            entry.node.clone(),
            entry.gpu_index.to_string(),
            sharing.to_owned(),
            format_sm_share(entry.sm_cap_permille),
            format_progress(entry.progress_per_s, entry.progress_hinted),
            format_progress(entry.progress_alone_per_s, entry.progress_hinted),
            work,
        ]);
    }
    table
}

/// A redistributed tenant's SM cap (thousandths of the GPU's SMs): `62.5% of the SMs`, or
/// `uncapped`.
fn format_sm_share(permille: u32) -> String {
    debug_assert!(permille > 0, "only for tenants the redistribution follows");
    if permille >= api::usage::SM_CAP_PERMILLE_FULL {
        return "uncapped".to_owned();
    }
    match permille % 10 {
        0 => format!("{}% of the SMs", permille / 10),
        tenths => format!("{}.{tenths}% of the SMs", permille / 10),
    }
}

/// A progress rate: `12.3 units/s` (the application's own, through `vgpu_progress`), `12.3
/// steps/s`, or `-` when not measured yet.
fn format_progress(per_second: f64, hinted: bool) -> String {
    if !(per_second.is_finite() && per_second > 0.0) {
        return NONE.to_owned();
    }
    let unit = if hinted { "units" } else { "steps" };
    format!("{per_second:.1} {unit}/s")
}

/// The `Health:` lines of one GPU in `describe node`.
fn health_text(text: &mut String, health: Option<&HealthView>, now_unix_ms: i64) {
    let Some(health) = health else {
        field(text, 4, "Health", "<not reported yet>");
        return;
    };
    let unsupported = |query: &str| health.unsupported.iter().any(|q| q == query);
    let xid = if unsupported("xid") {
        "unsupported".to_owned()
    } else if health.xid_errors == 0 {
        "0".to_owned()
    } else {
        format!(
            "{} (last XID {}, {})",
            health.xid_errors,
            health.last_xid,
            age(health.last_xid_unix_ms, now_unix_ms)
        )
    };
    field(text, 4, "XID errors", xid);
    let ecc = match (health.ecc_corrected, health.ecc_uncorrected) {
        (None, None) => "unsupported".to_owned(),
        (corrected, uncorrected) => format!(
            "{} corrected, {} uncorrected (volatile)",
            corrected.map_or_else(|| NONE.to_owned(), |c| c.to_string()),
            uncorrected.map_or_else(|| NONE.to_owned(), |u| u.to_string())
        ),
    };
    field(text, 4, "ECC errors", ecc);
    let throttle = if unsupported("throttle") {
        "unsupported".to_owned()
    } else if health.throttle_reasons.is_empty() {
        "none".to_owned()
    } else {
        health.throttle_reasons.join(", ")
    };
    field(text, 4, "Throttled", throttle);
    let optional = |value: Option<String>| value.unwrap_or_else(|| "unsupported".to_owned());
    field(
        text,
        4,
        "Temperature",
        optional(health.temperature_celsius.map(|c| format!("{c} C"))),
    );
    field(
        text,
        4,
        "Utilization",
        optional(health.utilization_percent.map(|p| format!("{p}%"))),
    );
    field(
        text,
        4,
        "Memory used",
        optional(health.memory_used_bytes.map(format_bytes)),
    );
    let processes = if unsupported("processes") {
        "unsupported".to_owned()
    } else {
        processes_text(&health.processes, true)
    };
    field(text, 4, "Processes", processes);
    field(
        text,
        4,
        "Reported",
        age(health.reported_unix_ms, now_unix_ms),
    );
}

fn slices_table(slices: &[SliceView]) -> Table {
    let mut table = Table::new(&[
        "NODE",
        "GPU",
        "UUID",
        "COMPUTE",
        "MEMORY",
        "GUARANTEED",
        "BURST",
    ]);
    for slice in slices {
        let memory = if slice.memory_limit_bytes > slice.memory_bytes {
            format!(
                "{} (limit {})",
                format_bytes(slice.memory_bytes),
                format_bytes(slice.memory_limit_bytes)
            )
        } else {
            format_bytes(slice.memory_bytes)
        };
        table.row(vec![
            slice.node.clone(),
            slice.gpu_index.to_string(),
            slice.gpu.clone(),
            format!("{}%", slice.compute_percent),
            memory,
            yes_no(slice.guaranteed).into(),
            yes_no(slice.burst).into(),
        ]);
    }
    table
}

/// `describe node NAME`. `tenants` (may be empty) gives each tenant's share of each GPU.
pub fn node_text(node: &NodeView, tenants: &[TenantView], now_unix_ms: i64) -> String {
    let mut text = String::new();
    field(&mut text, 0, "Name", &node.name);
    field(&mut text, 0, "State", &node.state);
    if node.kubernetes_managed {
        field(
            &mut text,
            0,
            "Managed by",
            "Kubernetes (pods get its GPUs through DRA claims; `vgpuctl place` never lands here)",
        );
    }
    field(&mut text, 0, "Address", or_none(node.address.clone()));
    if node.labels.is_empty() {
        field(&mut text, 0, "Labels", "<none>");
    } else {
        for (number, (key, value)) in node.labels.iter().enumerate() {
            let key_text = if number == 0 { "Labels:" } else { "" };
            writeln!(text, "{key_text:<KEY_WIDTH$}{key}={value}").expect("writing to a String");
        }
    }
    let heartbeat = match node.last_heartbeat_unix_ms {
        0 => "never".to_owned(),
        ms => format!("{} ({})", timestamp(ms), age(ms, now_unix_ms)),
    };
    field(&mut text, 0, "Last heartbeat", heartbeat);
    let compute: u64 = node
        .gpus
        .iter()
        .map(|gpu| u64::from(gpu.compute_allocated_percent))
        .sum();
    let memory: u64 = node.gpus.iter().map(|gpu| gpu.memory_allocated_bytes).sum();
    let memory_total: u64 = node.gpus.iter().map(|gpu| gpu.memory_bytes).sum();
    field(
        &mut text,
        0,
        "Allocated",
        format!(
            "compute {compute}%/{}%, memory {}/{}",
            node.gpus.len() * 100,
            format_bytes(memory),
            format_bytes(memory_total)
        ),
    );
    let cpu = match node.cpu_milli {
        0 => "not reported (unbounded)".to_owned(),
        total => format!(
            "{}/{} requested",
            api::cpu::format_cpu_milli(node.cpu_milli_allocated),
            api::cpu::format_cpu_milli(total)
        ),
    };
    field(&mut text, 0, "CPU", cpu);
    let host_memory = match node.host_memory_bytes {
        0 => "not reported (unbounded)".to_owned(),
        total => format!(
            "{}/{} requested",
            format_bytes(node.host_memory_allocated_bytes),
            format_bytes(total)
        ),
    };
    field(&mut text, 0, "Host memory", host_memory);
    field(&mut text, 0, "GPUs", node.gpus.len());
    for gpu in &node.gpus {
        writeln!(text, "  GPU {}:", gpu.index).expect("writing to a String");
        field(&mut text, 4, "UUID", &gpu.uuid);
        let sms = if gpu.sm_count > 0 {
            format!(" ({} SMs)", gpu.sm_count)
        } else {
            String::new()
        };
        field(
            &mut text,
            4,
            "Model",
            format!("{}{sms}", or_none(gpu.model.clone())),
        );
        field(
            &mut text,
            4,
            "Memory",
            format!(
                "{} ({} allocated)",
                format_bytes(gpu.memory_bytes),
                format_bytes(gpu.memory_allocated_bytes)
            ),
        );
        field(
            &mut text,
            4,
            "Compute",
            format!("{}% allocated", gpu.compute_allocated_percent),
        );
        let numa = if gpu.numa_node < 0 {
            "unknown".to_owned()
        } else {
            gpu.numa_node.to_string()
        };
        field(&mut text, 4, "NUMA node", numa);
        field(&mut text, 4, "PCI bus", or_none(gpu.pci_bus_id.clone()));
        let peers: Vec<String> = gpu
            .nvlink_peers
            .iter()
            .map(|peer| {
                let links = if peer.link_count == 1 {
                    "link"
                } else {
                    "links"
                };
                format!("GPU {} ({} {links})", peer.gpu_index, peer.link_count)
            })
            .collect();
        field(
            &mut text,
            4,
            "NVLink peers",
            if peers.is_empty() {
                "<none>".to_owned()
            } else {
                peers.join(", ")
            },
        );
        field(
            &mut text,
            4,
            "Nearest NICs",
            if gpu.nearest_nics.is_empty() {
                "<none>".to_owned()
            } else {
                gpu.nearest_nics.join(", ")
            },
        );
        let shares: Vec<String> = gpu
            .tenants
            .iter()
            .map(|name| {
                let slice = tenants
                    .iter()
                    .filter(|tenant| &tenant.name == name)
                    .flat_map(|tenant| &tenant.slices)
                    .find(|slice| {
                        slice.node == node.name
                            && (slice.gpu == gpu.uuid || slice.gpu_index == gpu.index)
                    });
                match slice {
                    Some(slice) => {
                        let kind = if slice.guaranteed {
                            "guaranteed"
                        } else {
                            "best effort"
                        };
                        let burst = if slice.burst { ", burst" } else { "" };
                        format!(
                            "{name} ({}%, {}, {kind}{burst})",
                            slice.compute_percent,
                            format_bytes(slice.memory_bytes)
                        )
                    }
                    None => name.clone(),
                }
            })
            .collect();
        if shares.is_empty() {
            field(&mut text, 4, "Tenants", "<none>");
        } else {
            for (number, share) in shares.iter().enumerate() {
                let key = if number == 0 { "Tenants:" } else { "" };
                writeln!(text, "    {key:<width$}{share}", width = KEY_WIDTH - 4)
                    .expect("writing to a String");
            }
        }
        health_text(&mut text, gpu.health.as_ref(), now_unix_ms);
    }
    if node.gpus.is_empty() {
        block(&mut text, 2, NONE);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::samples;

    #[test]
    fn tenant_text_shows_request_placement_and_history() {
        let text = tenant_text(
            &TenantView::from(&samples::placed_tenant()),
            1_700_000_012_000,
        );
        assert!(
            text.starts_with("Name:             infer-a\nState:            placed\n"),
            "{text}"
        );
        assert!(
            text.contains("  GPUs:           0.25 of one GPU\n"),
            "{text}"
        );
        assert!(text.contains("  Memory/GPU:     20GiB\n"), "{text}");
        assert!(text.contains("  Node selector:  zone=a\n"), "{text}");
        assert!(text.contains("  CPU:            <none>\n"), "{text}");
        assert!(text.contains("  GPU models:     any\n"), "{text}");
        let mut constrained = TenantView::from(&samples::placed_tenant());
        constrained.request.cpu_milli = 8_000;
        constrained.request.host_memory_bytes = 64 << 30;
        constrained.request.gpu_models = vec!["A100-80GB".into(), "H100-80GB".into()];
        let text = tenant_text(&constrained, 1_700_000_012_000);
        assert!(text.contains("  CPU:            8 per node\n"), "{text}");
        assert!(
            text.contains("  Host memory:    64GiB per node\n"),
            "{text}"
        );
        assert!(
            text.contains("  GPU models:     A100-80GB, H100-80GB\n"),
            "{text}"
        );
        assert!(
            text.contains("node-a   3     GPU-0003   25%       20GiB    yes          yes"),
            "{text}"
        );
        assert!(
            text.contains("2023-11-14 22:13:20.500Z   placed    placed on node-a"),
            "{text}"
        );
    }

    #[test]
    fn tenant_text_shows_usage_per_gpu() {
        let tenant = TenantView::from(&samples::placed_tenant());
        let text = tenant_text(&tenant, 1_700_000_012_000);
        assert!(
            text.contains(
                "  NODE     GPU   MEMORY USED/LIMIT   GPU TIME   PROCS   PIDS        REPORTED\n  node-a   3     3GiB/20GiB          12.3s      2       4242 3GiB   2s ago\n"
            ),
            "{text}"
        );
        let mut unreported = tenant.clone();
        unreported.usage.clear();
        let text = tenant_text(&unreported, 0);
        assert!(text.contains("Usage:\n  <none reported yet>\n"), "{text}");
    }

    #[test]
    fn tenant_text_shows_request_limit_and_borrowed_memory_per_gpu() {
        let mut tenant = TenantView::from(&samples::placed_tenant());
        let text = tenant_text(&tenant, 1_700_000_012_000);
        assert!(
            !text.contains("Elastic memory:"),
            "no board, no table: {text}"
        );
        tenant.request.memory_limit_bytes_per_gpu = 60 << 30;
        tenant.slices[0].memory_limit_bytes = 60 << 30;
        let usage = &mut tenant.usage[0];
        usage.memory_request_bytes = 20 << 30;
        usage.memory_board_limit_bytes = 60 << 30;
        usage.memory_resident_bytes = 26 << 30;
        usage.memory_borrowed_bytes = 6 << 30;
        usage.memory_swapped_bytes = 2 << 30;
        usage.memory_staging_bytes = 2 << 30;
        usage.memory_reclaims = 3;
        usage.memory_reclaimed_bytes = 7 << 30;
        usage.memory_last_reclaim_unix_ms = 1_700_000_000_000;
        let text = tenant_text(&tenant, 1_700_000_012_000);
        assert!(
            text.contains(
                "  Memory limit/GPU: 60GiB (borrowed above the request when the GPU has it free)\n"
            ),
            "{text}"
        );
        assert!(text.contains("20GiB (limit 60GiB)"), "{text}");
        assert!(
            text.contains(
                "Elastic memory:\n  NODE     GPU   REQUEST   LIMIT   RESIDENT   BORROWED   SWAPPED   STAGING   RECLAIMS                 WAITING\n  node-a   3     20GiB     60GiB   26GiB      6GiB       2GiB      2GiB      3 (7GiB), last 12s ago   -\n"
            ),
            "{text}"
        );
        // Processes waiting in the GPU's line: how many, and the longest wait.
        tenant.usage[0].memory_waiting_processes = 2;
        tenant.usage[0].memory_longest_wait_ms = 312_000;
        let text = tenant_text(&tenant, 1_700_000_012_000);
        assert!(text.contains("last 12s ago   2 for 5m12s\n"), "{text}");
        assert_eq!(
            [850, 42_000, 312_000, 7_380_000].map(format_wait),
            ["850ms", "42s", "5m12s", "2h03m"]
        );
        // Usage's limit is what it may use: the board's limit, not the request the ledger holds
        // ("26GiB/20GiB" read as a broken quota on an H200).
        tenant.usage[0].memory_used_bytes = 26 << 30;
        let text = tenant_text(&tenant, 1_700_000_012_000);
        assert!(text.contains("   26GiB/60GiB   "), "{text}");
    }

    #[test]
    fn tenant_text_shows_the_latency_target_and_what_it_achieved() {
        let tenant = TenantView::from(&samples::latency_tenant());
        let text = tenant_text(&tenant, 1_700_000_012_000);
        assert!(
            text.contains(
                "  Latency:        yes
"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "  Latency target: 2ms
"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "Latency:\n  NODE     GPU   TARGET   ALONE P99   P50     P99     STEPS   VIOLATIONS\n  node-a   3     2ms      1.4ms       900us   1.8ms   12000   7\n"
            ),
            "{text}"
        );
        // No target: the default, said in words; no measurements: no latency table.
        let mut derived = tenant.clone();
        derived.request.latency_target_us = 0;
        derived.usage[0].latency_target_us = 0;
        derived.usage[0].latency_steps = 0;
        derived.usage[0].latency_p99_us = 0;
        let text = tenant_text(&derived, 0);
        assert!(
            text.contains(
                "  Latency target: default (1.2x its latency alone)
"
            ),
            "{text}"
        );
        assert!(!text.contains("VIOLATIONS"), "{text}");
        // Not a latency tenant: no target line at all.
        let text = tenant_text(&TenantView::from(&samples::placed_tenant()), 0);
        assert!(!text.contains("Latency target"), "{text}");
        assert!(!text.contains("VIOLATIONS"), "{text}");
    }

    #[test]
    fn tenant_text_shows_the_sm_share_and_progress_of_a_redistributed_tenant() {
        let tenant = TenantView::from(&samples::redistributed_tenant());
        let text = tenant_text(&tenant, 1_700_000_012_000);
        assert!(
            text.contains(
                "SM redistribution:\n  NODE     GPU   SHARING        SM SHARE           PROGRESS       ALONE          WORK\n  node-a   3     side by side   62.5% of the SMs   12.3 units/s   30.9 units/s   0.40\n"
            ),
            "{text}"
        );
        // Uncapped, counted in steps; not measured yet.
        let mut uncapped = tenant.clone();
        uncapped.usage[0].sm_cap_permille = 1_000;
        uncapped.usage[0].progress_hinted = false;
        uncapped.usage[0].progress_alone_per_s = 0.0;
        uncapped.usage[0].redistribution_side_by_side = false;
        let text = tenant_text(&uncapped, 0);
        assert!(
            text.contains("   uncapped   12.3 steps/s   -       -\n"),
            "{text}"
        );
        uncapped.usage[0].progress_per_s = 0.0;
        let text = tenant_text(&uncapped, 0);
        assert!(
            text.contains("   uncapped   -          -       -\n"),
            "{text}"
        );
        assert_eq!(
            [500, 625, 8].map(format_sm_share),
            ["50% of the SMs", "62.5% of the SMs", "0.8% of the SMs"]
        );
        // Not followed: no section.
        let text = tenant_text(&TenantView::from(&samples::placed_tenant()), 0);
        assert!(!text.contains("SM redistribution"), "{text}");
        assert!(!text.contains("SM SHARE"), "{text}");
    }

    #[test]
    fn node_text_shows_gpu_health() {
        let mut node = NodeView::from(&samples::node());
        let now = node.last_heartbeat_unix_ms + 3000;
        node.gpus[0].health = Some(HealthView {
            xid_errors: 2,
            last_xid: 79,
            last_xid_unix_ms: now - 60_000,
            ecc_corrected: Some(4),
            ecc_uncorrected: Some(0),
            throttle_reasons: vec!["sw_power_cap".into(), "hw_slowdown".into()],
            temperature_celsius: Some(63),
            utilization_percent: None,
            memory_used_bytes: Some(3 << 30),
            unsupported: vec!["utilization".into()],
            processes: vec![ProcessView {
                pid: 77,
                memory_bytes: 3 << 30,
                tenant: "infer-a".into(),
            }],
            reported_unix_ms: now - 1000,
        });
        let text = node_text(&node, &[], now);
        for line in [
            "    XID errors:   2 (last XID 79, 60s ago)\n",
            "    ECC errors:   4 corrected, 0 uncorrected (volatile)\n",
            "    Throttled:    sw_power_cap, hw_slowdown\n",
            "    Temperature:  63 C\n",
            "    Utilization:  unsupported\n",
            "    Memory used:  3GiB\n",
            "    Processes:    77 infer-a 3GiB\n",
            "    Reported:     1s ago\n",
            "    Health:       <not reported yet>\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in:\n{text}");
        }
    }

    #[test]
    fn pending_tenant_has_no_placement() {
        let text = tenant_text(&TenantView::from(&samples::pending_tenant()), 0);
        assert!(
            text.contains("Reason:           no node has 8 free NVLink-connected GPUs\n"),
            "{text}"
        );
        assert!(text.contains("Placement:\n  <none>\n"), "{text}");
        assert!(
            text.contains("  GPUs:           8 per node on 2 nodes\n"),
            "{text}"
        );
    }

    #[test]
    fn node_text_shows_topology_and_tenant_shares() {
        let node = NodeView::from(&samples::node());
        let tenant = TenantView::from(&samples::placed_tenant());
        let mut placed = tenant.clone();
        placed.slices[0].gpu = "GPU-0000".into();
        placed.slices[0].gpu_index = 0;
        let text = node_text(&node, &[placed], node.last_heartbeat_unix_ms + 1000);
        assert!(text.contains("Labels:           zone=a\n"), "{text}");
        assert!(text.contains("(1s ago)"), "{text}");
        assert!(
            text.contains("CPU:              not reported (unbounded)\n"),
            "{text}"
        );
        assert!(
            text.contains("    NVLink peers: GPU 1 (18 links)\n"),
            "{text}"
        );
        assert!(
            text.contains("    Tenants:      infer-a (25%, 20GiB, guaranteed, burst)\n"),
            "{text}"
        );
        assert!(text.contains("    NUMA node:    0\n"), "{text}");
        let mut reported = node.clone();
        reported.cpu_milli = 96_000;
        reported.cpu_milli_allocated = 8_500;
        reported.host_memory_bytes = 1 << 40;
        reported.host_memory_allocated_bytes = 64 << 30;
        let text = node_text(&reported, &[], node.last_heartbeat_unix_ms);
        assert!(
            text.contains("CPU:              8.5/96 requested\n"),
            "{text}"
        );
        assert!(
            text.contains("Host memory:      64GiB/1TiB requested\n"),
            "{text}"
        );
        assert!(!text.contains("Managed by"), "{text}");
        let managed = NodeView {
            kubernetes_managed: true,
            ..node.clone()
        };
        let text = node_text(&managed, &[], node.last_heartbeat_unix_ms);
        assert!(
            text.contains("Managed by:       Kubernetes (pods get its GPUs through DRA claims"),
            "{text}"
        );
    }
}
