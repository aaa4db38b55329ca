//! Standalone runner: `cargo run -p engine-sim --example engine_sim -- --help`
//! (the gateway binary exposes the same flags as `tokengate engine-sim`).

use clap::Parser;

#[derive(Parser)]
#[command(name = "engine-sim", about = "A realistic fake LLM inference engine")]
struct Cli {
    #[command(flatten)]
    sim: engine_sim::SimArgs,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    engine_sim::run_cli(Cli::parse().sim).await
}
