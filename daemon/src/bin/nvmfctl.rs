//! `nvmfctl`: ask a running nvmfd how it is doing, through its admin socket.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use nvmfd::admin::Request;
use nvmfd::ctl;

/// Query a running nvmfd through its admin socket.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The daemon's admin socket.
    #[arg(
        long,
        short = 's',
        env = "NVMFD_SOCKET",
        default_value = "/run/nvmfd/nvmfd.sock",
        global = true
    )]
    socket: PathBuf,
    /// Print the daemon's JSON answer instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for the daemon.
    #[arg(long, default_value_t = 5, global = true)]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// What the daemon serves: reactors, listeners, subsystems.
    Status,
    /// Counters: reactors, admin socket, and the data path's.
    Stats {
        /// Prometheus text exposition format.
        #[arg(long, conflicts_with = "json")]
        prometheus: bool,
    },
    /// The configuration in force, defaults filled in (TOML; JSON with --json).
    Config,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let req = match cli.command {
        Command::Status => Request::Status {},
        Command::Stats { .. } => Request::Stats {},
        Command::Config => Request::Config {},
    };
    let mut data = match ctl::request(&cli.socket, &req, Duration::from_secs(cli.timeout)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("nvmfctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let text = if cli.json {
        serde_json::to_string_pretty(&data).unwrap_or_default() + "\n"
    } else {
        match cli.command {
            Command::Stats { prometheus: true } => ctl::render_prometheus(&data),
            Command::Config => {
                ctl::strip_nulls(&mut data);
                match toml::to_string(&data) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("nvmfctl: cannot print the configuration as TOML: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            _ => ctl::render_tables(&data),
        }
    };
    print!("{text}");
    ExitCode::SUCCESS
}
