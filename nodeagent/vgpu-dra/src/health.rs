//! Which GPUs the ResourceSlice taints, from the agent's health samples
//! (`vgpu_agent::health`: NVML on real GPUs, a JSON file in the state directory for simulated
//! ones), and the thread that samples them.
//!
//! [`unhealthy`] is pure. A GPU is tainted when it reported an XID that is not an application's
//! own error (13, 31, 43, 45, 68, 109: a kernel fault, a page fault, a stopped context; the GPU is
//! fine for the next claim) or uncorrected ECC errors. The taint stays while the sample says so:
//! the agent's XID count only grows until the driver restarts (a GPU that fell off the bus needs
//! a reset, and the driver's restart goes with it), and the volatile ECC count until the reboot.
//! Throttling is not a taint: it passes, and the compute share already bounds the neighbours.

use std::collections::BTreeMap;
use std::time::Duration;

use api::v1::GpuHealth;
use tokio::sync::watch;
use vgpu_agent::health::HealthSource;

/// XIDs that an application's own mistakes raise; they say nothing about the GPU.
pub const APPLICATION_XIDS: [u32; 6] = [13, 31, 43, 45, 68, 109];
/// How often the health thread samples by default.
pub const SAMPLE_PERIOD_DEFAULT: Duration = Duration::from_secs(10);

/// The GPUs to taint, by index, with the reason.
pub fn unhealthy(samples: &[GpuHealth]) -> BTreeMap<u32, String> {
    let mut tainted = BTreeMap::new();
    for sample in samples {
        let mut reasons = Vec::new();
        if sample.xid_errors > 0 && !APPLICATION_XIDS.contains(&sample.last_xid) {
            reasons.push(format!("xid-{}", sample.last_xid));
        }
        if sample.ecc_uncorrected.unwrap_or(0) > 0 {
            reasons.push("ecc-uncorrected".to_owned());
        }
        if !reasons.is_empty() {
            tainted.insert(sample.index, reasons.join("."));
        }
    }
    assert!(tainted.len() <= samples.len());
    tainted
}

/// Samples health on a thread of its own every `period` (NVML may block briefly; the runtime
/// must not) and publishes the tainted GPUs whenever they change. The thread ends at the first
/// sample after every receiver is gone. `open` makes the source on that thread, since an NVML
/// handle need not be `Send`.
pub fn spawn_sampler<F>(open: F, period: Duration) -> watch::Receiver<BTreeMap<u32, String>>
where
    F: FnOnce() -> Option<Box<dyn HealthSource>> + Send + 'static,
{
    assert!(
        period >= Duration::from_millis(100),
        "a sane sampling period"
    );
    let (sender, receiver) = watch::channel(BTreeMap::new());
    std::thread::Builder::new()
        .name("vgpu-dra-health".to_owned())
        .spawn(move || {
            let Some(mut source) = open() else {
                tracing::warn!(
                    "GPU health cannot be sampled on this node; no GPU will be tainted in the ResourceSlice"
                );
                return;
            };
            while !sender.is_closed() {
                let tainted = unhealthy(&source.sample());
                sender.send_if_modified(|current| {
                    if *current == tainted {
                        return false;
                    }
                    tracing::warn!("unhealthy GPUs (tainted in the ResourceSlice): {tainted:?}");
                    *current = tainted;
                    true
                });
                std::thread::sleep(period);
            }
        })
        .expect("a thread can be started");
    receiver
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(index: u32, xid: u32, uncorrected: u64) -> GpuHealth {
        let mut health = api::usage::empty_health("GPU-x", index);
        health.xid_errors = u64::from(xid > 0);
        health.last_xid = xid;
        health.ecc_uncorrected = Some(uncorrected);
        health.throttle_reasons = vec!["hw_thermal".to_owned()];
        health
    }

    #[test]
    fn device_faults_taint_and_application_errors_and_throttling_do_not() {
        let samples = [
            sample(0, 0, 0),
            sample(1, 79, 0),
            sample(2, 13, 0),
            sample(3, 0, 2),
            sample(4, 48, 1),
        ];
        let tainted = unhealthy(&samples);
        assert_eq!(
            tainted,
            BTreeMap::from([
                (1, "xid-79".to_owned()),
                (3, "ecc-uncorrected".to_owned()),
                (4, "xid-48.ecc-uncorrected".to_owned()),
            ])
        );
    }

    #[test]
    fn the_sampler_publishes_changes() {
        let root = tempfile::tempdir().unwrap();
        let inventory = vgpu_agent::InventorySource::from_simulate_arg("2xH100-80GB")
            .unwrap()
            .discover("node-a")
            .unwrap();
        let overrides = root.path().join(vgpu_agent::health::SIMULATED_HEALTH_FILE);
        std::fs::write(&overrides, r#"{"1": {"xid_errors": 1, "last_xid": 79}}"#).unwrap();
        let state = root.path().to_owned();
        let mut tainted = spawn_sampler(
            move || -> Option<Box<dyn HealthSource>> {
                Some(Box::new(vgpu_agent::health::SimulatedHealth::new(
                    &inventory, &state,
                )))
            },
            Duration::from_millis(100),
        );
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            let wait = Duration::from_secs(10);
            let seen = tokio::time::timeout(wait, tainted.wait_for(|t| t.contains_key(&1)))
                .await
                .unwrap()
                .unwrap()
                .clone();
            assert_eq!(seen, BTreeMap::from([(1, "xid-79".to_owned())]));
            std::fs::write(&overrides, "{}").unwrap();
            tokio::time::timeout(wait, tainted.wait_for(BTreeMap::is_empty))
                .await
                .unwrap()
                .unwrap();
        });
    }
}
