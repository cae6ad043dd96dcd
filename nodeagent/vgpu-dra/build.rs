//! Compiles the kubelet's plugin-registration and DRA protos (our own text of the published
//! contract, `proto/`) with the protoc binary vendored by `protoc-bin-vendored`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let mut config = tonic_prost_build::Config::new();
    config.protoc_executable(protoc);
    tonic_prost_build::configure().compile_with_config(
        config,
        &[
            "proto/pluginregistration/api.proto",
            "proto/dra/v1/api.proto",
        ],
        &["proto"],
    )?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
