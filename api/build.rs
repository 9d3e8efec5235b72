fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in ["agent", "common", "dsec", "admin", "node"] {
        println!("cargo:rerun-if-changed=proto/{proto}.proto");
    }
    // One run for both APIs: the messages of common.proto (package dsec.v1) are generated
    // once, into the public API's module, and the agent API refers to them there.
    tonic_prost_build::configure().compile_protos(
        &[
            "proto/agent.proto",
            "proto/dsec.proto",
            "proto/admin.proto",
            "proto/node.proto",
        ],
        &["proto"],
    )?;
    Ok(())
}
