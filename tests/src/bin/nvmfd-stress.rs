//! `nvmfd-stress`: runs nvmfd under the seeded stress of `nvmfd_tests::stress` for as long as
//! asked, printing progress and, at the end, the operations, the faults injected by kind and
//! the mismatches. Exits 1 if there was any mismatch; the seed printed replays the run.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use nvmfd_tests::stress::{self, Rates};

/// Seeded stress of nvmfd against a model of its namespaces.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    /// How long to send operations, in seconds (the final check comes after).
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Seed of the operations and the faults (default: drawn from the clock, and printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Controllers connected at once.
    #[arg(long, default_value_t = 2)]
    controllers: usize,
    /// Run without injected faults.
    #[arg(long)]
    no_faults: bool,
    /// Print a progress line this often, in seconds (0: never).
    #[arg(long, default_value_t = 10)]
    progress: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_secs() ^ u64::from(d.subsec_nanos()))
    });
    let mut cfg = stress::Config::new(seed, Duration::from_secs(cli.seconds));
    cfg.controllers = cli.controllers.max(1);
    cfg.progress = (cli.progress > 0).then(|| Duration::from_secs(cli.progress));
    if cli.no_faults {
        cfg.target_faults = Rates::default();
        cfg.host_faults = Rates::default();
    }
    eprintln!(
        "nvmfd-stress: seed {seed}, {} s, {} controllers; replay with --seed {seed}",
        cli.seconds, cfg.controllers
    );
    let report = stress::run(&cfg);
    println!("{report}");
    if report.mismatches.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "nvmfd-stress: MISMATCHES; replay with --seed {seed} --seconds {}",
            cli.seconds
        );
        ExitCode::FAILURE
    }
}
