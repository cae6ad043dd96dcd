//! Replays an agent's per-window trace through the controller, to see why it decided what it
//! did on a GPU run without another run:
//!
//! ```text
//! RUST_LOG=info,vgpu_agent::closed_loop::window=debug vgpu-agent join ... 2>agent.log
//! cargo run -p sharing --example replay -- agent.log [--mps --sm-count 132] [--dump HH:MM:SS.ffffff]
//! ```
//!
//! Each trace line gives a window's steps per latency tenant with their p50 and p99 only, so the
//! replay feeds an approximation: the window's steps at its p50, one of them at its p99 (a
//! window of a control period holds a few steps, and its p99 is their slowest). The levels it
//! prints are what this build's controller decides on those windows; they differ from the
//! run's where the approximation or a changed controller does, and after the first difference
//! the windows (measured at the run's levels) no longer answer the replay's. So it explains a
//! decision up to where the two part, no further. `--dump T` prints the controller's state after
//! the first window at or after T. The trace's `controller` part (`Controller::trace_summary`)
//! says the same of the run itself.
use sharing::{Config, Controller, Event, TenantWindow};
use tenant_abi::control::{LatencySnapshot, latency_bucket};

fn main() {
    let mut args = std::env::args().skip(1);
    let mut path = None;
    let mut mps = false;
    let mut sm_count = 0u16;
    let mut dump: Vec<String> = Vec::new();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--mps" => mps = true,
            "--sm-count" => {
                sm_count = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--sm-count N")
            }
            "--dump" => dump.push(args.next().expect("--dump HH:MM:SS.ffffff")),
            _ => path = Some(arg),
        }
    }
    let path = path.expect("usage: replay AGENT_LOG [--mps --sm-count N] [--dump TIME]");
    let text = std::fs::read_to_string(&path).expect("reading the trace");
    let mut controller = Controller::new(Config::new(mps, sm_count));
    let mut level_run = None;
    for line in text.lines() {
        let Some((clock, window)) = parse(line) else {
            continue;
        };
        let Window {
            now_ns,
            level,
            neighbours,
            open_ns,
            tenants,
        } = window;
        let output = controller.handle(Event::Window {
            now_ns,
            tenants,
            neighbours_active: neighbours,
            open_step_since_ns: open_ns.map(|open| now_ns.saturating_sub(open)),
        });
        if let Some(change) = &output.change {
            println!(
                "{clock} replay {} -> {} ({:?}); the run was at {level}",
                change.from.level, change.to.level, change.reason
            );
        }
        if level_run != Some(level) {
            println!("{clock} run level {level}");
            level_run = Some(level);
        }
        if let Some(at) = dump.first()
            && clock.as_str() >= at.as_str()
        {
            println!("{clock} state: {controller:#?}");
            dump.remove(0);
        }
    }
}

struct Window {
    now_ns: u64,
    level: u8,
    neighbours: bool,
    open_ns: Option<u64>,
    tenants: Vec<TenantWindow>,
}

/// `...T11:39:18.491813Z DEBUG vgpu_agent::closed_loop::window: GPU-... level 9 neighbours true
/// open Some(454) paused 0.0 ms bounded 0: lat-a: 3 steps p50 1.024 p99 1.152 ms; ...`
fn parse(line: &str) -> Option<(String, Window)> {
    let (_, rest) = line.split_once("closed_loop::window: ")?;
    let clock = line.split_once('T')?.1.get(..15)?.to_owned();
    let now_ns = clock_ns(&clock)?;
    let words: Vec<&str> = rest.split_whitespace().collect();
    let after = |key: &str| {
        words
            .iter()
            .position(|w| *w == key)
            .and_then(|i| words.get(i + 1))
    };
    let level = after("level")?.parse().ok()?;
    let neighbours = *after("neighbours")? == "true";
    let open_ns = after("open")?
        .strip_prefix("Some(")
        .and_then(|v| v.trim_end_matches(')').parse::<u64>().ok())
        .map(|us| us * 1_000);
    let (_, tenants_text) = rest.split_once(": ")?;
    let mut tenants = Vec::new();
    for part in tenants_text.split(';') {
        let part = part.trim();
        let Some((name, stats)) = part.split_once(": ") else {
            continue;
        };
        let stats: Vec<&str> = stats.split_whitespace().collect();
        if stats.len() < 6 || stats[1] != "steps" {
            continue;
        }
        let steps: u64 = stats[0].parse().ok()?;
        let ms = |v: &str| v.parse::<f64>().ok().map(|ms| (ms * 1e6) as u64);
        let (p50, p99) = (ms(stats[3])?, ms(stats[5])?);
        let mut window = LatencySnapshot::default();
        for i in 0..steps {
            // The trace's values are bucket edges: a hair below reads back as the same bucket.
            let latency = if i + 1 == steps { p99 } else { p50 }.saturating_sub(1);
            window.buckets[latency_bucket(latency)] += 1;
            window.steps += 1;
            window.total_ns += latency;
        }
        tenants.push(TenantWindow {
            name: name.to_owned(),
            window,
            target_ns: None,
        });
    }
    Some((
        clock,
        Window {
            now_ns,
            level,
            neighbours,
            open_ns,
            tenants,
        },
    ))
}

fn clock_ns(clock: &str) -> Option<u64> {
    let mut parts = clock.split(':');
    let h: u64 = parts.next()?.parse().ok()?;
    let m: u64 = parts.next()?.parse().ok()?;
    let s: f64 = parts.next()?.parse().ok()?;
    Some((h * 3600 + m * 60) * 1_000_000_000 + (s * 1e9) as u64 + 1)
}
