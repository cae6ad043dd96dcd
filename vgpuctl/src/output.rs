//! Rendering: JSON and YAML of the [`crate::views`] shapes, aligned tables for people, and the
//! small formatting helpers (sizes, GPU amounts, timestamps, ages) they share.

use std::collections::BTreeSet;
use std::io::Write;

use api::size::format_bytes;
use serde::Serialize;

use crate::views::{ClusterView, GpuView, NodeView, RequestView, SliceView, TenantView};

/// Spaces between table columns.
const COLUMN_GAP: usize = 3;
/// Shown in a table cell that has no value.
pub const NONE: &str = "-";

/// Writes `value` as pretty JSON or YAML, ending with a newline.
pub fn write_structured<T: Serialize>(
    out: &mut dyn Write,
    format: crate::Format,
    value: &T,
) -> anyhow::Result<()> {
    match format {
        crate::Format::Json => {
            serde_json::to_writer_pretty(&mut *out, value)?;
            writeln!(out)?;
        }
        crate::Format::Yaml => write!(out, "{}", serde_yaml::to_string(value)?)?,
        crate::Format::Table => unreachable!("tables are rendered by the caller"),
    }
    Ok(())
}

/// A table with a header row; columns are left-aligned and padded to their widest cell.
#[derive(Debug, Clone)]
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Table {
        assert!(!headers.is_empty(), "a table has columns");
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        assert_eq!(cells.len(), self.headers.len(), "one cell per column");
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as text, one line per row, without trailing spaces.
    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self
            .headers
            .iter()
            .map(|header| header.chars().count())
            .collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut text = String::new();
        let header: Vec<String> = self
            .headers
            .iter()
            .map(|header| (*header).to_owned())
            .collect();
        for row in std::iter::once(&header).chain(&self.rows) {
            let mut line = String::new();
            for (column, cell) in row.iter().enumerate() {
                line.push_str(cell);
                if column + 1 < row.len() {
                    let padding = widths[column] - cell.chars().count() + COLUMN_GAP;
                    line.extend(std::iter::repeat_n(' ', padding));
                }
            }
            text.push_str(line.trim_end());
            text.push('\n');
        }
        text
    }
}

/// `NAME STATE GPUS COMPUTE MEMORY NODE(S) REASON`.
pub fn tenants_table(tenants: &[TenantView]) -> Table {
    let mut table = Table::new(&[
        "NAME", "STATE", "GPUS", "COMPUTE", "MEMORY", "NODE(S)", "REASON",
    ]);
    for tenant in tenants {
        let nodes: BTreeSet<&str> = tenant
            .slices
            .iter()
            .map(|slice| slice.node.as_str())
            .collect();
        table.row(vec![
            tenant.name.clone(),
            tenant.state.clone(),
            gpu_amount(&tenant.request),
            compute_share(tenant),
            memory_share(tenant),
            or_none(nodes.into_iter().collect::<Vec<_>>().join(",")),
            or_none(tenant.reason.clone()),
        ]);
    }
    table
}

/// `NAME STATE GPUS ALLOCATED-COMPUTE ALLOCATED-MEMORY ALLOCATED-CPU LAST-HEARTBEAT`; the CPU is
/// `-` for a node whose agent reports none (unbounded). The state of a Kubernetes-managed node
/// says so (`ready (kubernetes)`): a suffix rather than a column, so the table of a pool without
/// such nodes reads as before.
pub fn nodes_table(nodes: &[NodeView], now_unix_ms: i64) -> Table {
    let mut table = Table::new(&[
        "NAME",
        "STATE",
        "GPUS",
        "ALLOCATED-COMPUTE",
        "ALLOCATED-MEMORY",
        "ALLOCATED-CPU",
        "LAST-HEARTBEAT",
    ]);
    for node in nodes {
        let compute: u64 = node
            .gpus
            .iter()
            .map(|gpu| u64::from(gpu.compute_allocated_percent))
            .sum();
        let memory: u64 = node.gpus.iter().map(|gpu| gpu.memory_allocated_bytes).sum();
        let memory_total: u64 = node.gpus.iter().map(|gpu| gpu.memory_bytes).sum();
        table.row(vec![
            node.name.clone(),
            if node.kubernetes_managed {
                format!("{} (kubernetes)", node.state)
            } else {
                node.state.clone()
            },
            node.gpus.len().to_string(),
            format!("{compute}%/{}%", node.gpus.len() * 100),
            format!("{}/{}", format_bytes(memory), format_bytes(memory_total)),
            match node.cpu_milli {
                0 => NONE.to_owned(),
                total => format!(
                    "{}/{}",
                    api::cpu::format_cpu_milli(node.cpu_milli_allocated),
                    api::cpu::format_cpu_milli(total)
                ),
            },
            age(node.last_heartbeat_unix_ms, now_unix_ms),
        ]);
    }
    table
}

/// `NODE INDEX UUID MODEL MEMORY COMPUTE% MEM-ALLOC TENANTS`.
pub fn gpus_table(gpus: &[GpuView]) -> Table {
    let mut table = Table::new(&[
        "NODE",
        "INDEX",
        "UUID",
        "MODEL",
        "MEMORY",
        "COMPUTE%",
        "MEM-ALLOC",
        "TENANTS",
    ]);
    for gpu in gpus {
        table.row(vec![
            gpu.node.clone(),
            gpu.index.to_string(),
            gpu.uuid.clone(),
            or_none(gpu.model.clone()),
            format_bytes(gpu.memory_bytes),
            format!("{}%", gpu.compute_allocated_percent),
            format_bytes(gpu.memory_allocated_bytes),
            or_none(gpu.tenants.join(",")),
        ]);
    }
    table
}

/// The human form of `cluster status`: a summary, then `ID ADDRESS ROLE VOTER MATCHED-INDEX`.
pub fn cluster_text(cluster: &ClusterView, endpoint: &str) -> String {
    let leader = match cluster
        .members
        .iter()
        .find(|member| member.id == cluster.leader)
    {
        _ if cluster.leader == 0 => {
            "none known (an election may be running, or no majority is up)".to_owned()
        }
        Some(member) => format!("{} ({})", member.id, member.address),
        None => cluster.leader.to_string(),
    };
    let mut text = String::new();
    text.push_str(&format!(
        "Cluster:        {}\n",
        or_none(cluster.cluster_id.clone())
    ));
    text.push_str(&format!("Leader:         {leader}\n"));
    text.push_str(&format!("Term:           {}\n", cluster.term));
    text.push_str(&format!(
        "Answered by:    {} (via {endpoint})\n",
        cluster.responder
    ));
    text.push_str(&format!(
        "Log:            last index {}, applied {}\n",
        cluster.last_log_index, cluster.last_applied
    ));
    text.push('\n');
    let mut table = Table::new(&["ID", "ADDRESS", "ROLE", "VOTER", "MATCHED-INDEX"]);
    for member in &cluster.members {
        let role = if member.id == cluster.leader {
            "leader"
        } else if member.voter {
            "follower"
        } else {
            "learner"
        };
        let matched = if cluster.responder == cluster.leader {
            member.matched_index.to_string()
        } else {
            NONE.into()
        };
        table.row(vec![
            member.id.to_string(),
            member.address.clone(),
            role.into(),
            yes_no(member.voter).into(),
            matched,
        ]);
    }
    text.push_str(&table.render());
    text
}

/// The requested GPU amount: `0.25`, `2`, or `16 (2x8)` for 2 nodes of 8 GPUs each.
pub fn gpu_amount(request: &RequestView) -> String {
    if request.milli_gpus > 0 {
        return format_milli(request.milli_gpus);
    }
    if request.nodes > 1 {
        let total = u64::from(request.nodes) * u64::from(request.whole_gpus);
        return format!("{total} ({}x{})", request.nodes, request.whole_gpus);
    }
    request.whole_gpus.to_string()
}

/// Thousandths of a GPU as a decimal: 250 -> `0.25`, 125 -> `0.125`.
pub fn format_milli(milli: u32) -> String {
    let text = format!("{}.{:03}", milli / 1000, milli % 1000);
    text.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// Microseconds in the largest unit that keeps them exact: 500 -> `500us`, 1500 -> `1.5ms`,
/// 2000000 -> `2s`. `--latency-target` reads every such text back to the same number.
pub fn format_latency(microseconds: u64) -> String {
    let (unit, scale, decimals) = match microseconds {
        1_000_000.. => ("s", 1_000_000, 6),
        1_000.. => ("ms", 1_000, 3),
        _ => ("us", 1, 0),
    };
    let (whole, fraction) = (microseconds / scale, microseconds % scale);
    if fraction == 0 {
        return format!("{whole}{unit}");
    }
    let fraction = format!("{fraction:0decimals$}");
    format!("{whole}.{}{unit}", fraction.trim_end_matches('0'))
}

/// Guaranteed compute per GPU: from the placement when placed, else from the request.
fn compute_share(tenant: &TenantView) -> String {
    let burst = if tenant.request.burst { "+burst" } else { "" };
    if let Some(percent) = uniform(&tenant.slices, |slice| slice.compute_percent) {
        return format!("{percent}%{burst}");
    }
    if !tenant.slices.is_empty() {
        return format!("mixed{burst}");
    }
    let request = &tenant.request;
    let percent = match request.compute_percent {
        0 if request.milli_gpus > 0 => request.milli_gpus.div_ceil(10),
        0 => 100,
        percent => percent,
    };
    format!("{percent}%{burst}")
}

/// Memory per GPU: from the placement when placed, else the request (`auto` for the default).
fn memory_share(tenant: &TenantView) -> String {
    if let Some(bytes) = uniform(&tenant.slices, |slice| slice.memory_bytes) {
        return format_bytes(bytes);
    }
    if !tenant.slices.is_empty() {
        return "mixed".into();
    }
    match tenant.request.memory_bytes_per_gpu {
        0 => "auto".into(),
        bytes => format_bytes(bytes),
    }
}

/// The value every slice has, if they agree and there is at least one.
fn uniform<T: PartialEq + Copy>(
    slices: &[SliceView],
    field: impl Fn(&SliceView) -> T,
) -> Option<T> {
    let first = field(slices.first()?);
    slices
        .iter()
        .all(|slice| field(slice) == first)
        .then_some(first)
}

/// One line for a placed tenant: `node-a GPU 3 (25%, 20GiB)`, or
/// `node-a GPUs 0,1; node-b GPUs 0,1 (100%, 80GiB each)`.
pub fn placement_summary(slices: &[SliceView]) -> String {
    if slices.is_empty() {
        return "no GPUs".into();
    }
    let mut nodes: Vec<(&str, Vec<u32>)> = Vec::new();
    for slice in slices {
        match nodes.iter_mut().find(|(node, _)| *node == slice.node) {
            Some((_, indexes)) => indexes.push(slice.gpu_index),
            None => nodes.push((slice.node.as_str(), vec![slice.gpu_index])),
        }
    }
    let where_ = nodes
        .iter()
        .map(|(node, indexes)| {
            let noun = if indexes.len() == 1 { "GPU" } else { "GPUs" };
            let list: Vec<String> = indexes.iter().map(u32::to_string).collect();
            format!("{node} {noun} {}", list.join(","))
        })
        .collect::<Vec<_>>()
        .join("; ");
    let burst = if slices.iter().any(|slice| slice.burst) {
        ", burst"
    } else {
        ""
    };
    match (
        uniform(slices, |s| s.compute_percent),
        uniform(slices, |s| s.memory_bytes),
    ) {
        (Some(percent), Some(bytes)) => {
            let each = if slices.len() > 1 { " each" } else { "" };
            format!(
                "{where_} ({percent}%, {}{each}{burst})",
                format_bytes(bytes)
            )
        }
        _ => slices
            .iter()
            .map(|s| {
                format!(
                    "{} GPU {} ({}%, {})",
                    s.node,
                    s.gpu_index,
                    s.compute_percent,
                    format_bytes(s.memory_bytes)
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
    }
}

pub fn yes_no(value: bool) -> &'static str {
    if value { "yes" } else { "no" }
}

pub fn or_none(text: String) -> String {
    if text.is_empty() {
        NONE.to_owned()
    } else {
        text
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX)
        })
}

/// How long ago, kubectl style: `12s`, `5m`, `3h`, `2d`; `never` for 0.
pub fn age(unix_ms: i64, now_unix_ms: i64) -> String {
    if unix_ms <= 0 {
        return "never".into();
    }
    let seconds = (now_unix_ms - unix_ms).max(0) / 1000;
    let text = match seconds {
        0..120 => format!("{seconds}s"),
        120..7200 => format!("{}m", seconds / 60),
        7200..172_800 => format!("{}h", seconds / 3600),
        _ => format!("{}d", seconds / 86_400),
    };
    format!("{text} ago")
}

/// A Unix-millisecond timestamp as UTC, `2023-11-14 22:13:20.000Z`; `-` for 0.
pub fn timestamp(unix_ms: i64) -> String {
    if unix_ms <= 0 {
        return NONE.into();
    }
    let days = unix_ms.div_euclid(86_400_000);
    let in_day = unix_ms.rem_euclid(86_400_000);
    let (year, month, day) = civil_from_days(days);
    let (hours, minutes) = (in_day / 3_600_000, in_day / 60_000 % 60);
    let (seconds, millis) = (in_day / 1000 % 60, in_day % 1000);
    format!("{year:04}-{month:02}-{day:02} {hours:02}:{minutes:02}:{seconds:02}.{millis:03}Z")
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (the well-known "days from civil"
/// inverse, by eras of 400 years).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    debug_assert!((1..=12).contains(&month) && (1..=31).contains(&day));
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::views::samples;

    #[test]
    fn tables_align_columns_without_trailing_spaces() {
        let mut table = Table::new(&["A", "LONGER"]);
        table.row(vec!["wide-cell".into(), "x".into()]);
        table.row(vec!["b".into(), String::new()]);
        assert_eq!(table.render(), "A           LONGER\nwide-cell   x\nb\n");
    }

    #[test]
    fn tenants_table_shows_placement_and_reason() {
        let tenants = [
            TenantView::from(&samples::placed_tenant()),
            TenantView::from(&samples::pending_tenant()),
        ];
        let text = tenants_table(&tenants).render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "NAME      STATE     GPUS       COMPUTE     MEMORY   NODE(S)   REASON"
        );
        assert_eq!(
            lines[1],
            "infer-a   placed    0.25       25%+burst   20GiB    node-a    -"
        );
        assert_eq!(
            lines[2],
            "train-b   pending   16 (2x8)   100%        auto     -         no node has 8 free NVLink-connected GPUs"
        );
    }

    #[test]
    fn nodes_and_gpus_tables_use_human_sizes() {
        let node = NodeView::from(&samples::node());
        let now = node.last_heartbeat_unix_ms + 3_000;
        let text = nodes_table(std::slice::from_ref(&node), now).render();
        assert_eq!(
            text,
            "NAME     STATE   GPUS   ALLOCATED-COMPUTE   ALLOCATED-MEMORY   ALLOCATED-CPU   LAST-HEARTBEAT\n\
             node-a   ready   2      25%/200%            20GiB/160GiB       -               3s ago\n"
        );
        let reported = NodeView {
            cpu_milli: 64_000,
            cpu_milli_allocated: 8_000,
            ..node.clone()
        };
        let text = nodes_table(std::slice::from_ref(&reported), now).render();
        assert!(
            text.contains("20GiB/160GiB       8/64            3s ago"),
            "{text}"
        );
        let managed = NodeView {
            kubernetes_managed: true,
            ..node.clone()
        };
        let text = nodes_table(std::slice::from_ref(&managed), now).render();
        assert!(text.contains("node-a   ready (kubernetes)   2 "), "{text}");
        let text = gpus_table(&node.gpus).render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "NODE     INDEX   UUID       MODEL                   MEMORY   COMPUTE%   MEM-ALLOC   TENANTS"
        );
        assert_eq!(
            lines[1],
            "node-a   0       GPU-0000   NVIDIA H100 80GB HBM3   80GiB    25%        20GiB       infer-a"
        );
        assert_eq!(
            lines[2],
            "node-a   1       GPU-0001   NVIDIA H100 80GB HBM3   80GiB    0%         0B          -"
        );
    }

    #[test]
    fn cluster_text_names_the_leader() {
        let text = cluster_text(&ClusterView::from(&samples::cluster()), "cp-1:7401");
        assert!(text.contains("Leader:         2 (cp-2:7401)"), "{text}");
        assert!(
            text.contains("2    cp-2:7401   leader     yes     -"),
            "{text}"
        );
        assert!(text.contains("1    cp-1:7401   follower"), "{text}");
    }

    #[test]
    fn placement_summaries() {
        let tenant = TenantView::from(&samples::placed_tenant());
        assert_eq!(
            placement_summary(&tenant.slices),
            "node-a GPU 3 (25%, 20GiB, burst)"
        );
        let slice = |node: &str, index| SliceView {
            node: node.into(),
            gpu: format!("GPU-{index}"),
            gpu_index: index,
            compute_percent: 100,
            memory_bytes: 80 << 30,
            guaranteed: true,
            burst: false,
            memory_limit_bytes: 80 << 30,
        };
        let slices = [slice("a", 0), slice("a", 1), slice("b", 0), slice("b", 1)];
        assert_eq!(
            placement_summary(&slices),
            "a GPUs 0,1; b GPUs 0,1 (100%, 80GiB each)"
        );
    }

    #[test]
    fn numbers_and_times() {
        assert_eq!(format_milli(250), "0.25");
        assert_eq!(format_milli(125), "0.125");
        assert_eq!(format_milli(1), "0.001");
        assert_eq!(format_latency(500), "500us");
        assert_eq!(format_latency(1_500), "1.5ms");
        assert_eq!(format_latency(2_000), "2ms");
        assert_eq!(format_latency(1_000_001), "1.000001s");
        assert_eq!(format_latency(60_000_000), "60s");
        for microseconds in [10, 999, 1_001, 12_345, 2_500_000, 60_000_000] {
            assert_eq!(
                crate::cli::parse_latency_target(&format_latency(microseconds)),
                Ok(microseconds)
            );
        }
        assert_eq!(timestamp(0), "-");
        assert_eq!(timestamp(1_700_000_000_123), "2023-11-14 22:13:20.123Z");
        assert_eq!(timestamp(951_782_400_000), "2000-02-29 00:00:00.000Z");
        assert_eq!(age(0, 5), "never");
        assert_eq!(age(1_000, 13_000), "12s ago");
        assert_eq!(age(1, 1 + 3 * 3_600_000), "3h ago");
    }
}
