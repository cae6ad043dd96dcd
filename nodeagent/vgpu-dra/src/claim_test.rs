//! Tests of `claim`: tenant names, quantities, allocations read from claims, assignments.

use super::*;
use k8s_openapi::api::resource::v1::{
    AllocationResult, DeviceAllocationResult, DeviceRequestAllocationResult, ResourceClaimSpec,
    ResourceClaimStatus,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use vgpu_agent::InventorySource;

fn claim_ref(name: &str) -> ClaimRef {
    ClaimRef {
        namespace: "ml".into(),
        name: name.into(),
        uid: "3f2a9c1e-0b7d-4e5f-8a6b-1c2d3e4f5a6b".into(),
    }
}

fn inventory() -> Inventory {
    InventorySource::from_simulate_arg("2xH100-80GB")
        .unwrap()
        .discover("node-a")
        .unwrap()
}

fn result(device: &str, consumed: &[(&str, &str)]) -> DeviceRequestAllocationResult {
    DeviceRequestAllocationResult {
        driver: DRIVER_NAME.into(),
        pool: "node-a".into(),
        device: device.into(),
        request: "gpu".into(),
        consumed_capacity: (!consumed.is_empty()).then(|| {
            consumed
                .iter()
                .map(|(name, value)| ((*name).to_owned(), Quantity((*value).to_owned())))
                .collect()
        }),
        share_id: Some("0a1b2c3d".into()),
        ..Default::default()
    }
}

fn resource_claim(uid: &str, results: Vec<DeviceRequestAllocationResult>) -> ResourceClaim {
    ResourceClaim {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some("train".into()),
            namespace: Some("ml".into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        spec: ResourceClaimSpec::default(),
        status: Some(ResourceClaimStatus {
            allocation: Some(AllocationResult {
                devices: Some(DeviceAllocationResult {
                    results: Some(results),
                    config: None,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

#[test]
fn tenants_are_named_after_the_claim_and_its_uid() {
    assert_eq!(tenant_name(&claim_ref("train")), "train-3f2a9c1e");
    assert_eq!(
        tenant_name(&claim_ref("Pod_0.gpu-claim")),
        "pod-0-gpu-claim-3f2a9c1e"
    );
    let long = tenant_name(&claim_ref(&"x".repeat(253)));
    assert_eq!(long.len(), api::names::NAME_LENGTH_MAX);
    assert!(long.ends_with("-3f2a9c1e"));
    let odd = ClaimRef {
        uid: String::new(),
        ..claim_ref("---")
    };
    assert_eq!(tenant_name(&odd), "claim");
}

#[test]
fn quantities_are_whole_numbers() {
    assert_eq!(parse_quantity("20Gi"), Ok(20 << 30));
    assert_eq!(parse_quantity("85899345920"), Ok(85_899_345_920));
    assert_eq!(parse_quantity("25"), Ok(25));
    assert_eq!(parse_quantity("80G"), Ok(80_000_000_000));
    assert_eq!(parse_quantity("1.5Gi"), Ok(3 << 29));
    assert_eq!(parse_quantity("25000m"), Ok(25));
    assert_eq!(parse_quantity("2e3"), Ok(2000));
    for bad in [
        "",
        "Gi",
        "1.5",
        "500m",
        "20GiB",
        "-1",
        "1e99",
        "99999999999999999999Ei",
    ] {
        assert!(parse_quantity(bad).is_err(), "{bad}");
    }
}

#[test]
fn an_allocation_is_read_from_the_claim() {
    let wanted = claim_ref("train");
    let claim = resource_claim(
        &wanted.uid,
        vec![result("gpu-1", &[("memory", "20Gi"), ("compute", "25")])],
    );
    let allocation = allocation_from_claim(&claim, &wanted, "node-a").unwrap();
    assert_eq!(allocation.devices.len(), 1);
    assert_eq!(allocation.devices[0].device, "gpu-1");
    assert_eq!(allocation.devices[0].consumed["memory"], "20Gi");

    let replaced = resource_claim("00000000-0000-0000-0000-000000000000", vec![]);
    let error = allocation_from_claim(&replaced, &wanted, "node-a").unwrap_err();
    assert!(matches!(error, ClaimError::Replaced { .. }), "{error}");
    let mut other_driver = result("gpu-0", &[]);
    other_driver.driver = "gpu.nvidia.com".into();
    let error = allocation_from_claim(
        &resource_claim(&wanted.uid, vec![other_driver]),
        &wanted,
        "node-a",
    )
    .unwrap_err();
    assert!(matches!(error, ClaimError::NoDevices(_)), "{error}");
    let error = allocation_from_claim(&claim, &wanted, "node-b").unwrap_err();
    assert!(error.to_string().contains("--node-name"), "{error}");
    let mut admin = result("gpu-0", &[]);
    admin.admin_access = Some(true);
    let error = allocation_from_claim(&resource_claim(&wanted.uid, vec![admin]), &wanted, "node-a")
        .unwrap_err();
    assert!(matches!(error, ClaimError::AdminAccess(_)), "{error}");
    let mut unallocated = claim.clone();
    unallocated.status = None;
    let error = allocation_from_claim(&unallocated, &wanted, "node-a").unwrap_err();
    assert!(matches!(error, ClaimError::NotAllocated(_)), "{error}");
}

#[test]
fn consumed_capacity_is_the_slice_and_none_is_the_whole_gpu() {
    let inventory = inventory();
    let allocation = Allocation {
        claim: claim_ref("train"),
        devices: vec![
            AllocatedDevice {
                request: "small".into(),
                pool: "node-a".into(),
                device: "gpu-1".into(),
                consumed: BTreeMap::from([
                    ("memory".into(), "20Gi".into()),
                    ("compute".into(), "25".into()),
                ]),
            },
            AllocatedDevice {
                request: "whole".into(),
                pool: "node-a".into(),
                device: "gpu-0".into(),
                consumed: BTreeMap::new(),
            },
        ],
    };
    let assignment = assignment(&allocation, &inventory).unwrap();
    assert_eq!(assignment.tenant, "train-3f2a9c1e");
    let slices: Vec<(u32, u32, u64)> = assignment
        .slices
        .iter()
        .map(|slice| (slice.gpu_index, slice.compute_percent, slice.memory_bytes))
        .collect();
    assert_eq!(
        slices,
        [(0, 100, inventory.gpus[0].memory_bytes), (1, 25, 20 << 30)]
    );
    assert_eq!(assignment.slices[1].gpu_uuid, inventory.gpus[1].uuid);
    assert!(assignment.slices.iter().all(|s| s.guaranteed && !s.burst));
}

#[test]
fn two_requests_on_one_gpu_add_up_and_too_much_is_refused() {
    let inventory = inventory();
    let device = |compute: &str| AllocatedDevice {
        request: "r".into(),
        pool: "node-a".into(),
        device: "gpu-0".into(),
        consumed: BTreeMap::from([
            ("memory".into(), "10Gi".into()),
            ("compute".into(), compute.into()),
        ]),
    };
    let twice = Allocation {
        claim: claim_ref("train"),
        devices: vec![device("25"), device("50")],
    };
    let assignment = assignment(&twice, &inventory).unwrap();
    assert_eq!(assignment.slices.len(), 1);
    assert_eq!(assignment.slices[0].compute_percent, 75);
    assert_eq!(assignment.slices[0].memory_bytes, 20 << 30);

    let over = Allocation {
        claim: claim_ref("train"),
        devices: vec![device("60"), device("50")],
    };
    assert!(matches!(
        crate::claim::assignment(&over, &inventory),
        Err(ClaimError::OutOfRange { .. })
    ));
    let mut unknown = device("10");
    unknown.device = "gpu-9".into();
    let error = crate::claim::assignment(
        &Allocation {
            claim: claim_ref("train"),
            devices: vec![unknown],
        },
        &inventory,
    )
    .unwrap_err();
    assert!(matches!(error, ClaimError::UnknownDevice { .. }), "{error}");
}
