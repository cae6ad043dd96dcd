//! One function per subcommand: build the request (validated locally first, so bad input fails
//! fast with the same message the server would give), call the control plane through
//! [`Endpoints`], and print the result to `out` in the chosen format. Notes for people go to stderr.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use api::v1::cluster_client::ClusterClient;
use api::v1::pool_client::PoolClient;
use api::v1::{
    AddMemberRequest, ClusterStatusRequest, DrainRequest, GetNodeRequest, GetTenantRequest,
    ListPageRequest, Node, NvlinkPolicy, PlaceRequest, PlacementRequest, ReleaseRequest,
    RemoveMemberRequest, RemoveNodeRequest, SetTenantRequest, Tenant, TenantState,
};
use serde::Serialize;

use crate::cli::{
    ClusterCommand, Command, DescribeTarget, GetArgs, GpuAmount, Kind, NodeCommand, PlaceArgs,
    SetTarget, SetTenantArgs, merge_selectors,
};
use crate::endpoints::{Delivery, Endpoints};
use crate::output::{self, write_structured};
use crate::views::{ClusterView, GpuView, NodeView, TenantView};
use crate::{Format, UsageError};

/// Pause between polls while `place` waits for a pending tenant.
pub const PLACE_POLL_INTERVAL_MS: u64 = 200;

/// What every command needs: where to send calls and how to print.
pub struct Session {
    pub endpoints: Endpoints,
    pub format: Format,
}

/// Runs one subcommand.
pub async fn execute(
    command: &Command,
    session: &Session,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    match command {
        Command::Place(args) => place(args, session, out).await,
        Command::Set {
            target: SetTarget::Tenant(args),
        } => set_tenant(args, session, out).await,
        Command::Release { name } => release(name, session, out).await,
        Command::Get(args) => get(args, session, out).await,
        Command::Describe { target } => describe(target, session, out).await,
        Command::Drain { node } => drain(node, true, session, out).await,
        Command::Uncordon { node } => drain(node, false, session, out).await,
        Command::Cluster { command } => cluster(command, session, out).await,
        Command::Node {
            command: NodeCommand::Remove { node },
        } => remove_node(node, session, out).await,
    }
}

/// Most pages one listing reads (a page holds up to 1,000 items): a bound, not a size any pool
/// reaches.
pub const LIST_PAGES_MAX: usize = 1000;

/// Reads every page of a listing: `fetch(token)` gets the page after `token`.
async fn all_pages<T, F, Fut>(what: &str, mut fetch: F) -> anyhow::Result<Vec<T>>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<(Vec<T>, String)>>,
{
    let mut items = Vec::new();
    let mut token = String::new();
    for _ in 0..LIST_PAGES_MAX {
        let (page, next) = fetch(token).await?;
        items.extend(page);
        if next.is_empty() {
            return Ok(items);
        }
        token = next;
    }
    anyhow::bail!(
        "the {what} did not end within {LIST_PAGES_MAX} pages; the pool is larger than vgpuctl lists"
    )
}

async fn remove_node(node: &str, session: &Session, out: &mut dyn Write) -> anyhow::Result<()> {
    let advice = "check with `vgpuctl get nodes` before removing it again";
    session
        .endpoints
        .call(
            &format!("removal of node {node}"),
            Delivery::AtMostOnce,
            advice,
            |channel| {
                let request = RemoveNodeRequest {
                    node: node.to_owned(),
                };
                async move { PoolClient::new(channel).remove_node(request).await }
            },
        )
        .await?;
    match session.format {
        Format::Table => writeln!(
            out,
            "node {node} removed: its tenants are re-placed elsewhere; an agent still running for it registers it again"
        )?,
        format => write_structured(
            out,
            format,
            &serde_json::json!({ "name": node, "removed": true }),
        )?,
    }
    Ok(())
}

/// The API request for `place` flags, checked with [`api::validate::admit_request`].
pub fn placement_request(args: &PlaceArgs) -> Result<PlacementRequest, UsageError> {
    let (whole_gpus, milli_gpus) = match args.gpus {
        GpuAmount::Whole(count) => (count, 0),
        GpuAmount::Milli(milli) => (0, milli),
    };
    let nvlink = if args.nvlink {
        NvlinkPolicy::Require
    } else if args.ignore_nvlink {
        NvlinkPolicy::Ignore
    } else {
        NvlinkPolicy::Prefer
    };
    let request = PlacementRequest {
        whole_gpus,
        milli_gpus,
        memory_bytes_per_gpu: args.memory.unwrap_or(0),
        memory_limit_bytes_per_gpu: args.memory_limit.unwrap_or(0),
        compute_percent: args.compute.unwrap_or(0),
        burst: args.burst,
        priority: args.priority,
        preemptible: args.preemptible,
        nvlink: nvlink as i32,
        nodes: args.nodes.unwrap_or(0),
        node_selector: merge_selectors(&args.selector)
            .map_err(UsageError)?
            .into_iter()
            .collect(),
        owner: args.owner.clone().unwrap_or_default(),
        bandwidth_weight: args.bandwidth.unwrap_or(0),
        latency: args.latency,
        latency_target_us: args.latency_target.unwrap_or(0),
        cpu_milli: args.cpu.unwrap_or(0),
        host_memory_bytes: args.host_memory.unwrap_or(0),
        // Sorted and once each, so that placing again with the flags in another order is the
        // same request (placing is idempotent only for an identical one).
        gpu_models: args
            .gpu_models
            .iter()
            .cloned()
            .collect::<std::collections::BTreeSet<String>>()
            .into_iter()
            .collect(),
        // Pins are the DRA driver's (a Kubernetes claim's slices), never a person's.
        pin: None,
    };
    api::validate::admit_request(&request).map_err(|error| UsageError(error.to_string()))?;
    Ok(request)
}

async fn place(args: &PlaceArgs, session: &Session, out: &mut dyn Write) -> anyhow::Result<()> {
    let request = placement_request(args)?;
    let name = &args.name;
    // Place is idempotent for an identical request, so the failover may resend it.
    let response = session
        .endpoints
        .call(
            &format!("place of tenant {name}"),
            Delivery::Idempotent,
            "",
            |channel| {
                let place = PlaceRequest {
                    name: name.clone(),
                    request: Some(request.clone()),
                };
                async move { PoolClient::new(channel).place(place).await }
            },
        )
        .await?;
    let mut tenant = response
        .tenant
        .context("the control plane accepted the tenant but sent it back empty; check with `vgpuctl get tenants`")?;
    if let Some(warning) = dropped_constraints(&request, tenant.request.as_ref()) {
        eprintln!("warning: {warning}");
    }
    let wait = if args.no_wait {
        Duration::ZERO
    } else {
        Duration::from_secs(args.wait_timeout)
    };
    let deadline = Instant::now() + wait;
    while tenant.state != TenantState::Placed as i32 {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        tokio::time::sleep((deadline - now).min(Duration::from_millis(PLACE_POLL_INTERVAL_MS)))
            .await;
        tenant = get_tenant(session, name, false).await?;
    }
    let view = TenantView::from(&tenant);
    if session.format != Format::Table {
        return write_structured(out, session.format, &view);
    }
    if view.state == "placed" {
        writeln!(
            out,
            "tenant {name} placed: {}",
            output::placement_summary(&view.slices)
        )?;
    } else {
        let reason = if view.reason.is_empty() {
            "waiting for capacity"
        } else {
            &view.reason
        };
        writeln!(out, "tenant {name} is {}: {reason}", view.state)?;
        if !wait.is_zero() {
            eprintln!(
                "note: still {} after {}s; it stays queued and is placed when capacity frees up. Follow it with `vgpuctl describe tenant {name}`, or cancel it with `vgpuctl release {name}`.",
                view.state, args.wait_timeout
            );
        }
    }
    Ok(())
}

/// What the control plane dropped of the whole-node constraints `sent` (`--cpu`,
/// `--host-memory`, `--gpu-model`), judging by the request it `kept`: a member of an earlier
/// version does not know these fields and places without them. `None` when nothing was dropped
/// (or the tenant existed already with another request, which the answer says itself).
pub fn dropped_constraints(
    sent: &PlacementRequest,
    kept: Option<&PlacementRequest>,
) -> Option<String> {
    let kept = kept?;
    let mut dropped = Vec::new();
    if sent.cpu_milli > 0 && kept.cpu_milli == 0 {
        dropped.push("--cpu");
    }
    if sent.host_memory_bytes > 0 && kept.host_memory_bytes == 0 {
        dropped.push("--host-memory");
    }
    if !sent.gpu_models.is_empty() && kept.gpu_models.is_empty() {
        dropped.push("--gpu-model");
    }
    if dropped.is_empty() {
        return None;
    }
    Some(format!(
        "the control plane placed the tenant without {}: its members run an earlier version that does not know them. Release the tenant (`vgpuctl release NAME`), upgrade every member, and place it again",
        dropped.join(", ")
    ))
}

/// The API request for `set tenant` flags, checked with [`api::validate::validate_change`].
pub fn set_tenant_request(args: &SetTenantArgs) -> Result<SetTenantRequest, UsageError> {
    let change = SetTenantRequest {
        name: args.name.clone(),
        compute_percent: args.compute,
        priority: args.priority,
        latency_target_us: args.latency_target,
    };
    api::validate::validate_change(&change).map_err(|error| UsageError(error.to_string()))?;
    Ok(change)
}

async fn set_tenant(
    args: &SetTenantArgs,
    session: &Session,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let change = set_tenant_request(args)?;
    let name = &args.name;
    // Setting values is idempotent (the same values again change nothing), so the failover may
    // resend it.
    let response = session
        .endpoints
        .call(
            &format!("change of tenant {name}"),
            Delivery::Idempotent,
            "",
            |channel| {
                let change = change.clone();
                async move { PoolClient::new(channel).set_tenant(change).await }
            },
        )
        .await?;
    let tenant = response
        .tenant
        .context("the control plane changed the tenant but sent it back empty; check with `vgpuctl describe tenant`")?;
    let view = TenantView::from(&tenant);
    if session.format != Format::Table {
        return write_structured(out, session.format, &view);
    }
    let mut settings = Vec::new();
    if !view.slices.is_empty() {
        settings.push(output::placement_summary(&view.slices));
    } else {
        settings.push(format!("{} (not placed)", view.state));
    }
    settings.push(format!("priority {}", view.priority));
    if view.request.latency {
        settings.push(match view.request.latency_target_us {
            0 => "latency target default".to_owned(),
            target => format!("latency target {}", output::format_latency(target)),
        });
    }
    writeln!(out, "tenant {name} set: {}", settings.join(", "))?;
    Ok(())
}

async fn release(name: &str, session: &Session, out: &mut dyn Write) -> anyhow::Result<()> {
    let advice = format!("check with `vgpuctl get tenants {name}` before releasing it again");
    session
        .endpoints
        .call(
            &format!("release of tenant {name}"),
            Delivery::AtMostOnce,
            &advice,
            |channel| {
                let release = ReleaseRequest {
                    name: name.to_owned(),
                };
                async move { PoolClient::new(channel).release(release).await }
            },
        )
        .await?;
    #[derive(Serialize)]
    struct Released<'a> {
        name: &'a str,
        released: bool,
    }
    match session.format {
        Format::Table => writeln!(out, "tenant {name} released")?,
        format => write_structured(
            out,
            format,
            &Released {
                name,
                released: true,
            },
        )?,
    }
    Ok(())
}

async fn get_tenant(session: &Session, name: &str, stale: bool) -> anyhow::Result<Tenant> {
    let tenant = session
        .endpoints
        .call(
            &format!("read of tenant {name}"),
            Delivery::Idempotent,
            "",
            |channel| {
                let get = GetTenantRequest {
                    name: name.to_owned(),
                    stale,
                };
                async move { PoolClient::new(channel).get_tenant(get).await }
            },
        )
        .await?;
    Ok(tenant)
}

async fn list_tenants(session: &Session, stale: bool) -> anyhow::Result<Vec<Tenant>> {
    let mut tenants = all_pages("list of tenants", |page_token| async move {
        let response = session
            .endpoints
            .call("list of tenants", Delivery::Idempotent, "", |channel| {
                let request = ListPageRequest {
                    stale,
                    page_token: page_token.clone(),
                };
                async move { PoolClient::new(channel).list_tenants_page(request).await }
            })
            .await?;
        Ok((response.tenants, response.next_page_token))
    })
    .await?;
    tenants.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(tenants)
}

async fn get_node(session: &Session, name: &str, stale: bool) -> anyhow::Result<Node> {
    let node = session
        .endpoints
        .call(
            &format!("read of node {name}"),
            Delivery::Idempotent,
            "",
            |channel| {
                let get = GetNodeRequest {
                    name: name.to_owned(),
                    stale,
                };
                async move { PoolClient::new(channel).get_node(get).await }
            },
        )
        .await?;
    Ok(node)
}

async fn list_nodes(session: &Session, stale: bool) -> anyhow::Result<Vec<Node>> {
    let mut nodes = all_pages("list of nodes", |page_token| async move {
        let response = session
            .endpoints
            .call("list of nodes", Delivery::Idempotent, "", |channel| {
                let request = ListPageRequest {
                    stale,
                    page_token: page_token.clone(),
                };
                async move { PoolClient::new(channel).list_nodes_page(request).await }
            })
            .await?;
        Ok((response.nodes, response.next_page_token))
    })
    .await?;
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(nodes)
}

/// Prints one object, or a list (an array in JSON/YAML, a table otherwise).
fn print_objects<T: Serialize>(
    out: &mut dyn Write,
    format: Format,
    objects: &[T],
    single: bool,
    what: &str,
    table: impl FnOnce(&[T]) -> output::Table,
) -> anyhow::Result<()> {
    assert!(
        !single || objects.len() == 1,
        "a single object is one object"
    );
    match format {
        Format::Table if objects.is_empty() => eprintln!("No {what} found."),
        Format::Table => write!(out, "{}", table(objects).render())?,
        format if single => write_structured(out, format, &objects[0])?,
        format => write_structured(out, format, &objects)?,
    }
    Ok(())
}

async fn get(args: &GetArgs, session: &Session, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.node.is_some() && args.kind != Kind::Gpus {
        return Err(UsageError("--node only applies to `vgpuctl get gpus`".into()).into());
    }
    let name = args.name.as_deref();
    match args.kind {
        Kind::Tenants => {
            let tenants = match name {
                Some(name) => {
                    api::names::validate("tenant", name)
                        .map_err(|error| UsageError(error.to_string()))?;
                    vec![get_tenant(session, name, args.stale).await?]
                }
                None => list_tenants(session, args.stale).await?,
            };
            let views: Vec<TenantView> = tenants.iter().map(TenantView::from).collect();
            print_objects(
                out,
                session.format,
                &views,
                name.is_some(),
                "tenants",
                output::tenants_table,
            )
        }
        Kind::Nodes => {
            let nodes = match name {
                Some(name) => {
                    api::names::validate("node", name)
                        .map_err(|error| UsageError(error.to_string()))?;
                    vec![get_node(session, name, args.stale).await?]
                }
                None => list_nodes(session, args.stale).await?,
            };
            let views: Vec<NodeView> = nodes.iter().map(NodeView::from).collect();
            let now = output::now_unix_ms();
            print_objects(
                out,
                session.format,
                &views,
                name.is_some(),
                "nodes",
                |nodes| output::nodes_table(nodes, now),
            )
        }
        Kind::Gpus => {
            let nodes = match &args.node {
                Some(node) => vec![get_node(session, node, args.stale).await?],
                None => list_nodes(session, args.stale).await?,
            };
            let mut gpus: Vec<GpuView> = nodes
                .iter()
                .flat_map(|node| node.gpus.iter().map(|gpu| GpuView::of(gpu, &node.name)))
                .collect();
            gpus.sort_by(|a, b| (&a.node, a.index).cmp(&(&b.node, b.index)));
            if let Some(uuid) = name {
                gpus.retain(|gpu| gpu.uuid == uuid);
                if gpus.is_empty() {
                    anyhow::bail!(
                        "no GPU has the uuid `{uuid}`; list the GPUs with `vgpuctl get gpus`"
                    );
                }
            }
            print_objects(
                out,
                session.format,
                &gpus,
                name.is_some(),
                "GPUs",
                output::gpus_table,
            )
        }
    }
}

async fn describe(
    target: &DescribeTarget,
    session: &Session,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    match target {
        DescribeTarget::Tenant { name, stale } => {
            let tenant = TenantView::from(&get_tenant(session, name, *stale).await?);
            match session.format {
                Format::Table => write!(
                    out,
                    "{}",
                    crate::describe::tenant_text(&tenant, output::now_unix_ms())
                )?,
                format => write_structured(out, format, &tenant)?,
            }
        }
        DescribeTarget::Node { name, stale } => {
            let node = NodeView::from(&get_node(session, name, *stale).await?);
            if session.format != Format::Table {
                return write_structured(out, session.format, &node);
            }
            // The shares of each tenant are only on the tenants; without them, names still show.
            let tenants = match list_tenants(session, *stale).await {
                Ok(tenants) => tenants.iter().map(TenantView::from).collect(),
                Err(error) => {
                    tracing::warn!("cannot list tenants, so their shares are left out: {error:#}");
                    Vec::new()
                }
            };
            write!(
                out,
                "{}",
                crate::describe::node_text(&node, &tenants, output::now_unix_ms())
            )?;
        }
    }
    Ok(())
}

async fn drain(
    node: &str,
    cordon: bool,
    session: &Session,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let verb = if cordon { "drain" } else { "uncordon" };
    // Both set a target state, so sending either twice does no harm.
    let response = session
        .endpoints
        .call(
            &format!("{verb} of node {node}"),
            Delivery::Idempotent,
            "",
            |channel| {
                let request = DrainRequest {
                    node: node.to_owned(),
                };
                async move {
                    let mut client = PoolClient::new(channel);
                    if cordon {
                        client.drain(request).await
                    } else {
                        client.uncordon(request).await
                    }
                }
            },
        )
        .await?;
    match (session.format, response.node) {
        (Format::Table, _) if cordon => writeln!(
            out,
            "node {node} drained: nothing new lands on it and its tenants are re-placed elsewhere"
        )?,
        (Format::Table, _) => writeln!(out, "node {node} uncordoned")?,
        (format, Some(node)) => write_structured(out, format, &NodeView::from(&node))?,
        (format, None) => write_structured(out, format, &serde_json::json!({ "name": node }))?,
    }
    Ok(())
}

async fn cluster(
    command: &ClusterCommand,
    session: &Session,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let endpoints = &session.endpoints;
    let status = match command {
        ClusterCommand::Status => {
            endpoints
                .call(
                    "cluster status",
                    Delivery::Idempotent,
                    "",
                    |channel| async move {
                        ClusterClient::new(channel)
                            .status(ClusterStatusRequest {})
                            .await
                    },
                )
                .await?
        }
        ClusterCommand::Remove { id } => {
            let advice = "check with `vgpuctl cluster status` before removing it again";
            let status = endpoints
                .call(
                    &format!("removal of member {id}"),
                    Delivery::AtMostOnce,
                    advice,
                    |channel| async move {
                        ClusterClient::new(channel)
                            .remove_member(RemoveMemberRequest { id: *id })
                            .await
                    },
                )
                .await?;
            if session.format == Format::Table {
                writeln!(out, "member {id} removed")?;
                return Ok(());
            }
            status
        }
        ClusterCommand::Add { id, address } => {
            let advice = "check with `vgpuctl cluster status` before adding it again";
            let status = endpoints
                .call(
                    &format!("addition of member {id}"),
                    Delivery::AtMostOnce,
                    advice,
                    |channel| {
                        let add = AddMemberRequest {
                            id: *id,
                            address: address.clone(),
                        };
                        async move { ClusterClient::new(channel).add_member(add).await }
                    },
                )
                .await?;
            if session.format == Format::Table {
                writeln!(out, "member {id} ({address}) added")?;
                return Ok(());
            }
            status
        }
    };
    let view = ClusterView::from(&status);
    match session.format {
        Format::Table => write!(
            out,
            "{}",
            output::cluster_text(&view, endpoints.preferred_address())
        )?,
        format => write_structured(out, format, &view)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use clap::Parser as _;

    use super::*;
    use crate::Cli;
    use crate::endpoints::{CallError, EndpointsConfig};
    use crate::fake::{self, Mode, State};

    /// Issue 19: flags are sorted and once each in the request, and a control plane that drops
    /// them (an earlier version) is noticed.
    #[test]
    fn constraints_reach_the_request_and_dropped_ones_are_noticed() {
        let cli = Cli::try_parse_from([
            "vgpuctl",
            "place",
            "t",
            "--gpus",
            "1",
            "--cpu",
            "8",
            "--gpu-model",
            "H100-80GB",
            "--gpu-model",
            "A100-80GB",
            "--gpu-model",
            "H100-80GB",
        ])
        .unwrap();
        let crate::cli::Command::Place(args) = cli.command else {
            panic!("expected place")
        };
        let request = placement_request(&args).unwrap();
        assert_eq!(request.cpu_milli, 8_000);
        assert_eq!(request.gpu_models, vec!["A100-80GB", "H100-80GB"]);
        assert_eq!(dropped_constraints(&request, Some(&request)), None);
        assert_eq!(dropped_constraints(&request, None), None);
        let older = PlacementRequest {
            whole_gpus: 1,
            ..Default::default()
        };
        let warning = dropped_constraints(&request, Some(&older)).unwrap();
        assert!(
            warning.contains("--cpu, --gpu-model") && warning.contains("upgrade every member"),
            "{warning}"
        );
        let too_many = PlaceArgs {
            cpu: Some(api::validate::CPU_MILLI_MAX + 1),
            ..args
        };
        let error = placement_request(&too_many).unwrap_err().0;
        assert!(error.contains("--cpu 8"), "{error}");
    }

    /// Runs a command line against `addresses` and returns its outcome and stdout.
    async fn run_against(
        addresses: &[&str],
        timeout_ms: u64,
        args: &[&str],
    ) -> (anyhow::Result<()>, String) {
        let cli =
            Cli::try_parse_from(std::iter::once("vgpuctl").chain(args.iter().copied())).unwrap();
        let config = EndpointsConfig {
            addresses: addresses
                .iter()
                .map(|address| (*address).to_owned())
                .collect(),
            call_timeout: Duration::from_millis(timeout_ms),
            connect_timeout: Duration::from_millis(timeout_ms.min(1000)),
            transport: api::tls::Transport::Insecure,
        };
        let session = Session {
            endpoints: Endpoints::new(config),
            format: cli.output.unwrap_or(Format::Table),
        };
        let mut out = Vec::new();
        let result = execute(&cli.command, &session, &mut out).await;
        (result, String::from_utf8(out).unwrap())
    }

    fn call_error(result: anyhow::Result<()>) -> CallError {
        result
            .expect_err("the command should fail")
            .downcast::<CallError>()
            .expect("a CallError")
    }

    #[tokio::test]
    async fn place_prints_where_the_tenant_landed() {
        let server = fake::start(State::new(Mode::Serve, Some(0)));
        let args = [
            "place",
            "infer-a",
            "--gpus",
            "0.25",
            "--memory",
            "20GiB",
            "--compute",
            "25",
        ];
        let (result, out) = run_against(&[&server.address], 5000, &args).await;
        result.unwrap();
        assert_eq!(
            out,
            "tenant infer-a placed: node-a GPU 3 (25%, 20GiB, burst)\n"
        );
        let request = server.state.tenants.lock().unwrap()["infer-a"]
            .request
            .clone()
            .unwrap();
        assert_eq!(request.milli_gpus, 250);
        assert_eq!(request.memory_bytes_per_gpu, 20 << 30);
        assert_eq!(request.nvlink, NvlinkPolicy::Prefer as i32);
        // Placing again with the same request is safe and answers the same.
        let (again, out) = run_against(&[&server.address], 5000, &args).await;
        again.unwrap();
        assert!(out.starts_with("tenant infer-a placed"), "{out}");
    }

    #[tokio::test]
    async fn place_waits_for_a_pending_tenant_then_reports_it_placed() {
        let server = fake::start(State::new(Mode::Serve, Some(3)));
        let (result, out) = run_against(
            &[&server.address],
            5000,
            &["place", "wait-a", "--gpus", "1"],
        )
        .await;
        result.unwrap();
        assert!(
            out.starts_with("tenant wait-a placed: node-a GPU 3"),
            "{out}"
        );
    }

    #[tokio::test]
    async fn place_reports_a_tenant_still_pending_after_the_wait() {
        let server = fake::start(State::new(Mode::Serve, None));
        let args = [
            "place",
            "big",
            "--gpus",
            "2",
            "--wait-timeout",
            "1",
            "-o",
            "json",
        ];
        let (result, out) = run_against(&[&server.address], 5000, &args).await;
        result.unwrap();
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(json["state"], "pending");
        assert_eq!(json["reason"], "no GPU has 25% compute free");
        assert!(server.state.calls.load(Ordering::SeqCst) >= 3, "it polled");

        let (result, out) = run_against(
            &[&server.address],
            5000,
            &["place", "big", "--gpus", "2", "--no-wait"],
        )
        .await;
        result.unwrap();
        assert_eq!(out, "tenant big is pending: no GPU has 25% compute free\n");
    }

    #[tokio::test]
    async fn bad_requests_fail_before_anything_is_sent() {
        let server = fake::start(State::new(Mode::Serve, Some(0)));
        let args = ["place", "spread", "--gpus", "0.5", "--nodes", "2"];
        let (result, _) = run_against(&[&server.address], 5000, &args).await;
        let error = result.unwrap_err();
        assert_eq!(crate::exit_code(&error), crate::EXIT_USAGE);
        assert!(error.to_string().contains("cannot span 2 nodes"), "{error}");
        assert_eq!(server.state.calls.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn a_latency_target_travels_with_a_latency_tenant_only() {
        let server = fake::start(State::new(Mode::Serve, Some(0)));
        let args = ["place", "chat", "--gpus", "0.25", "--latency-target", "2ms"];
        let (result, _) = run_against(&[&server.address], 5000, &args).await;
        let error = result.unwrap_err();
        assert_eq!(crate::exit_code(&error), crate::EXIT_USAGE);
        assert!(error.to_string().contains("add `--latency`"), "{error}");
        assert_eq!(server.state.calls.load(Ordering::SeqCst), 0);

        let args = [
            "place",
            "chat",
            "--gpus",
            "0.25",
            "--latency",
            "--latency-target",
            "2ms",
        ];
        run_against(&[&server.address], 5000, &args)
            .await
            .0
            .unwrap();
        let request = server.state.tenants.lock().unwrap()["chat"]
            .request
            .clone()
            .unwrap();
        assert!(request.latency);
        assert_eq!(request.latency_target_us, 2_000);
    }

    #[tokio::test]
    async fn set_tenant_sends_the_change_and_prints_the_result() {
        let server = fake::start(State::new(Mode::Serve, Some(0)));
        let address = [server.address.as_str()];
        let args = ["place", "chat", "--gpus", "0.25", "--latency"];
        run_against(&address, 5000, &args).await.0.unwrap();
        let args = [
            "set",
            "tenant",
            "chat",
            "--compute",
            "40",
            "--latency-target",
            "1.5ms",
            "--priority",
            "5",
        ];
        let (result, out) = run_against(&address, 5000, &args).await;
        result.unwrap();
        assert_eq!(
            out,
            "tenant chat set: node-a GPU 3 (40%, 20GiB, burst), priority 5, latency target 1.5ms\n"
        );
        let (result, out) = run_against(
            &address,
            5000,
            &["set", "tenant", "chat", "--priority", "1", "-o", "json"],
        )
        .await;
        result.unwrap();
        let json: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(json["priority"], 1);
        assert_eq!(json["request"]["latency_target_us"], 1_500);

        // Nothing to change: refused before anything is sent.
        let calls = server.state.calls.load(Ordering::SeqCst);
        let (result, _) = run_against(&address, 5000, &["set", "tenant", "chat"]).await;
        let error = result.unwrap_err();
        assert_eq!(crate::exit_code(&error), crate::EXIT_USAGE);
        assert!(error.to_string().contains("say what to change"), "{error}");
        assert_eq!(server.state.calls.load(Ordering::SeqCst), calls);
        // The control plane's refusals keep their code.
        let (result, _) = run_against(
            &address,
            5000,
            &["set", "tenant", "ghost", "--priority", "1"],
        )
        .await;
        assert_eq!(
            call_error(result).code(),
            Some(api::ErrorCode::TenantNotFound)
        );
        let (result, _) = run_against(
            &address,
            5000,
            &["set", "tenant", "chat", "--compute", "90"],
        )
        .await;
        let error = call_error(result);
        assert_eq!(error.code(), Some(api::ErrorCode::Unplaceable));
        assert!(error.to_string().contains("room for 75%"), "{error}");
    }

    #[tokio::test]
    async fn failover_skips_dead_and_leaderless_members() {
        let dead = fake::dead_address();
        let leaderless = fake::start(State::new(Mode::NoLeader, Some(0)));
        let healthy = fake::start(State::new(Mode::Serve, Some(0)));
        let addresses = [
            dead.as_str(),
            leaderless.address.as_str(),
            healthy.address.as_str(),
        ];
        let (result, out) = run_against(&addresses, 5000, &["place", "a", "--gpus", "1"]).await;
        result.unwrap();
        assert!(out.starts_with("tenant a placed"), "{out}");
        assert_eq!(leaderless.state.calls.load(Ordering::SeqCst), 1);
        // A release is safe to resend after NO-LEADER: that answer means nothing was written.
        *healthy.state.mode.lock().unwrap() = Mode::Serve;
        let (result, out) = run_against(&addresses, 5000, &["release", "a"]).await;
        result.unwrap();
        assert_eq!(out, "tenant a released\n");
    }

    #[tokio::test]
    async fn a_release_with_an_unknown_outcome_is_not_resent() {
        let unsure = fake::start(State::new(Mode::Unavailable, Some(0)));
        let healthy = fake::start(State::new(Mode::Serve, Some(0)));
        let addresses = [unsure.address.as_str(), healthy.address.as_str()];
        let (result, _) = run_against(&addresses, 5000, &["release", "a"]).await;
        let error = call_error(result);
        assert!(matches!(error, CallError::Ambiguous { .. }), "{error}");
        assert!(
            error.to_string().contains("vgpuctl get tenants a"),
            "{error}"
        );
        assert_eq!(healthy.state.calls.load(Ordering::SeqCst), 0);
        // Place is idempotent, so it moves on to the next member.
        let (result, _) = run_against(&addresses, 5000, &["place", "a", "--gpus", "1"]).await;
        result.unwrap();
        assert_eq!(healthy.state.calls.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_release_skips_a_member_that_does_not_answer_at_all() {
        // A stopped member still accepts connections; the liveness check finds another one
        // before the release is sent anywhere.
        let hanging = fake::start(State::new(Mode::Hang, Some(0)));
        let healthy = fake::start(State::new(Mode::Serve, Some(0)));
        let addresses = [hanging.address.as_str(), healthy.address.as_str()];
        run_against(&[&healthy.address], 5000, &["place", "a", "--gpus", "1"])
            .await
            .0
            .unwrap();
        let (result, out) = run_against(&addresses, 1000, &["release", "a"]).await;
        result.unwrap();
        assert_eq!(out, "tenant a released\n");
    }

    #[tokio::test]
    async fn a_hanging_member_is_given_up_on_for_reads() {
        let hanging = fake::start(State::new(Mode::Hang, Some(0)));
        let healthy = fake::start(State::new(Mode::Serve, Some(0)));
        let addresses = [hanging.address.as_str(), healthy.address.as_str()];
        let (result, out) = run_against(&addresses, 500, &["get", "nodes", "-o", "json"]).await;
        result.unwrap();
        assert!(out.starts_with('['), "{out}");
    }

    #[tokio::test]
    async fn no_live_member_is_reported_with_every_address() {
        let (first, second) = (fake::dead_address(), fake::dead_address());
        let (result, _) = run_against(&[&first, &second], 300, &["get", "tenants"]).await;
        let error = result.unwrap_err();
        assert_eq!(crate::exit_code(&error), crate::EXIT_UNREACHABLE);
        let text = error.to_string();
        assert!(
            text.starts_with(&format!("none of the endpoints {first},{second} answered")),
            "{text}"
        );
        assert!(text.contains("is vgpu-cp running?"), "{text}");
    }

    #[tokio::test]
    async fn server_errors_keep_the_human_message_and_the_code() {
        let server = fake::start(State::new(Mode::Serve, Some(0)));
        let (result, _) = run_against(&[&server.address], 5000, &["release", "ghost"]).await;
        let error = call_error(result);
        assert_eq!(error.code(), Some(api::ErrorCode::TenantNotFound));
        assert_eq!(
            error.to_string(),
            "there is no tenant ghost; list them with `vgpuctl get tenants` (VGPU-TENANT-NOT-FOUND)"
        );
    }

    #[tokio::test]
    async fn get_prints_arrays_for_lists_and_objects_for_names() {
        let server = fake::start(State::new(Mode::Serve, Some(0)));
        run_against(
            &[&server.address],
            5000,
            &["place", "infer-a", "--gpus", "0.25"],
        )
        .await
        .0
        .unwrap();
        let address = [server.address.as_str()];

        let (_, out) = run_against(&address, 5000, &["get", "tenants", "-o", "json"]).await;
        let list: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(list[0]["name"], "infer-a");
        assert_eq!(list[0]["state"], "placed");
        let (_, out) =
            run_against(&address, 5000, &["get", "tenant", "infer-a", "-o", "json"]).await;
        let one: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(one["name"], "infer-a");
        let (_, out) =
            run_against(&address, 5000, &["get", "tenants", "infer-a", "-o", "yaml"]).await;
        assert!(out.starts_with("name: infer-a\nstate: placed\n"), "{out}");
        let (_, out) = run_against(&address, 5000, &["get", "tenants"]).await;
        assert!(out.starts_with("NAME      STATE    GPUS"), "{out}");

        let (_, out) = run_against(&address, 5000, &["get", "nodes", "-o", "json"]).await;
        let nodes: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(nodes[0]["gpus"][1]["index"], 1);
        let (_, out) = run_against(&address, 5000, &["get", "gpus", "-o", "json"]).await;
        let gpus: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(gpus.as_array().unwrap().len(), 2);
        assert_eq!(gpus[1]["node"], "node-a");
        let (_, out) =
            run_against(&address, 5000, &["get", "gpus", "GPU-0001", "-o", "json"]).await;
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&out).unwrap()["index"],
            1
        );
        let (result, _) = run_against(&address, 5000, &["get", "gpus", "GPU-9"]).await;
        assert!(
            result
                .unwrap_err()
                .to_string()
                .contains("no GPU has the uuid")
        );
    }

    #[tokio::test]
    async fn describe_drain_and_cluster_commands() {
        let server = fake::start(State::new(Mode::Serve, Some(0)));
        let address = [server.address.as_str()];
        run_against(&address, 5000, &["place", "infer-a", "--gpus", "0.25"])
            .await
            .0
            .unwrap();

        let (result, out) = run_against(&address, 5000, &["describe", "tenant", "infer-a"]).await;
        result.unwrap();
        assert!(out.contains("Placement:"), "{out}");
        let (result, out) = run_against(&address, 5000, &["describe", "node", "node-a"]).await;
        result.unwrap();
        assert!(out.contains("NVLink peers:"), "{out}");
        let (result, out) = run_against(&address, 5000, &["drain", "node-a"]).await;
        result.unwrap();
        assert!(out.starts_with("node node-a drained"), "{out}");
        let (result, out) =
            run_against(&address, 5000, &["uncordon", "node-a", "-o", "json"]).await;
        result.unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&out).unwrap()["state"],
            "ready"
        );

        let (result, out) = run_against(&address, 5000, &["cluster", "status", "-o", "json"]).await;
        result.unwrap();
        let status: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(status["leader"], 2);
        assert_eq!(status["members"].as_array().unwrap().len(), 3);
        let (result, out) = run_against(&address, 5000, &["cluster", "status"]).await;
        result.unwrap();
        assert!(out.contains("Leader:         2 (cp-2:7401)"), "{out}");
        let (result, out) = run_against(&address, 5000, &["cluster", "remove", "3"]).await;
        result.unwrap();
        assert_eq!(out, "member 3 removed\n");
    }
}
