//! `ncclEnvPlugin_v1` through the built library, as NCCL 2.28+ uses it when `NCCL_ENV_PLUGIN`
//! names it: several "ranks" (processes of this test binary) on one GPU of the fake driver ask
//! for `NCCL_HOSTID` at once; each must get an identity no other rank on that GPU has, the first
//! the environment's own; a slot frees when its process ends; every other variable reads
//! through unchanged.

#![allow(unsafe_code)]

use std::ffi::{CStr, CString};
use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use vgpu_nccl::abi::*;

mod support;
use support::{fake_cuda_env, library, ok};

/// One rank: prints what the env plugin answers, then holds its slot until stdin closes.
#[test]
#[ignore = "a rank of env_plugin_gives_each_rank_on_a_gpu_its_own_host_identity"]
fn env_rank() {
    // SAFETY: our own plugin; the symbol is its static ncclEnv_v1_t table.
    unsafe {
        let lib = libloading::Library::new(library()).expect("dlopen libvgpu_nccl.so");
        let env = &**lib
            .get::<*const ncclEnv_v1_t>(b"ncclEnvPlugin_v1\0")
            .expect("ncclEnvPlugin_v1");
        ok((env.init)(2, 28, 9, c"".as_ptr()), "env init");
        let get = |name: &str| {
            let name = CString::new(name).unwrap();
            let v = (env.getEnv)(name.as_ptr());
            if v.is_null() {
                "<unset>".to_owned()
            } else {
                CStr::from_ptr(v).to_string_lossy().into_owned()
            }
        };
        let first = get("NCCL_HOSTID");
        // asked again, the same answer (NCCL may read it more than once)
        assert_eq!(get("NCCL_HOSTID"), first);
        println!("HOSTID {first}");
        println!("PASS {}", get("VGPU_TEST_PASSTHROUGH"));
        println!("MISSING {}", get("VGPU_TEST_NOT_SET"));
        println!("READY");
        let mut rest = String::new();
        std::io::stdin().read_to_string(&mut rest).unwrap();
        ok((env.finalize)(), "env finalize");
    }
}

struct Rank {
    child: Child,
    hostid: String,
    pass: String,
    missing: String,
}

fn start(dir: &Path, extra: &[(&str, &str)]) -> Rank {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env("VGPU_NCCL_NO_BUILD", "1")
        .envs(fake_cuda_env())
        .env("VGPU_SHM_DIR", dir)
        .env("NCCL_HOSTID", "vgpu-node-a-trainer")
        .env("VGPU_TEST_PASSTHROUGH", "as set")
        .env_remove("VGPU_TEST_NOT_SET")
        .envs(extra.iter().copied())
        .args([
            "env_rank",
            "--exact",
            "--nocapture",
            "--test-threads=1",
            "--ignored",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start a rank");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut field = |key: &str| loop {
        let line = lines.next().expect("the rank ended early").unwrap();
        // the harness prints "test env_rank ... " before the test's own first line
        if let Some(at) = line.find(key) {
            return line[at + key.len()..].trim().to_owned();
        }
    };
    let (hostid, pass, missing) = (field("HOSTID "), field("PASS "), field("MISSING "));
    field("READY");
    // keep draining in the background so the rank never blocks on a full pipe
    std::thread::spawn(move || lines.for_each(drop));
    Rank {
        child,
        hostid,
        pass,
        missing,
    }
}

fn stop(mut r: Rank) {
    drop(r.child.stdin.take());
    assert!(r.child.wait().unwrap().success(), "a rank failed");
}

#[test]
fn env_plugin_gives_each_rank_on_a_gpu_its_own_host_identity() {
    library();
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("envplugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = "vgpu-node-a-trainer";
    let ranks: Vec<Rank> = (0..3).map(|_| start(&dir, &[])).collect();
    let mut ids: Vec<&str> = ranks.iter().map(|r| r.hostid.as_str()).collect();
    ids.sort();
    assert_eq!(
        ids,
        [
            base.to_owned(),
            format!("{base}-slot1"),
            format!("{base}-slot2")
        ],
        "three ranks on one GPU: the environment's identity, then one per slot"
    );
    for r in &ranks {
        assert_eq!(r.pass, "as set", "other variables read through");
        assert_eq!(r.missing, "<unset>");
    }
    // without a current GPU the environment's identity stands, whatever slots are held
    let lost = start(&dir, &[("FAKE_CUDA_NO_CONTEXT", "1")]);
    assert_eq!(lost.hostid, base);
    stop(lost);
    // the rank holding slot 0 ends: the next rank takes its slot (the lock died with it)
    let mut ranks = ranks;
    let first = ranks.iter().position(|r| r.hostid == base).unwrap();
    stop(ranks.remove(first));
    let next = start(&dir, &[]);
    assert_eq!(next.hostid, base, "slot 0 is free again");
    stop(next);
    for r in ranks {
        stop(r);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
