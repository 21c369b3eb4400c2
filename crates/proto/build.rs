//! Generates the prost types from `proto/` with protox, so building needs no `protoc` binary.
//! protox resolves `google/protobuf/*.proto` itself; prost maps `Timestamp` to `prost_types`.

use std::error::Error;

fn main() -> Result<(), Box<dyn Error>> {
    const ENVELOPE: &str = "proto/nudge/v1/envelope.proto";
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile([ENVELOPE], ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
