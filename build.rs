//! Compiles the `agq.v1` protos with a vendored `protoc`, so a fresh machine
//! needs no system protobuf compiler, and writes the file descriptor set that
//! server reflection serves.

use std::{env, error::Error, path::PathBuf};

fn main() -> Result<(), Box<dyn Error>> {
    if env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        // SAFETY: build scripts are single-threaded; nothing else reads the
        // environment concurrently.
        unsafe { env::set_var("PROTOC", protoc) };
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    let protos = [
        "proto/agq/v1/common.proto",
        "proto/agq/v1/plan_service.proto",
        "proto/agq/v1/action_service.proto",
        "proto/agq/v1/job_service.proto",
        "proto/agq/v1/worker_service.proto",
        "proto/agq/v1/queue_service.proto",
        "proto/agq/v1/schedule_service.proto",
    ];
    tonic_prost_build::configure()
        // tonic-prost's encoding with smaller first buffers (src/pb/codec.rs).
        .codec_path("crate::pb::codec::Codec")
        .file_descriptor_set_path(out_dir.join("agq_descriptor.bin"))
        .compile_protos(&protos, &["proto"])?;
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    Ok(())
}
