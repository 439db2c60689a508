//! `nvmfd`: the NVMe over Fabrics target daemon.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use nvmfd::{control, logging, system_facts};
use nvmfd_config::Config;
use slog::{error, info, warn};

/// nvmfd: a kernel-bypass NVMe over Fabrics target.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Configuration file to serve.
    #[arg(
        long,
        short = 'c',
        value_name = "PATH",
        default_value = "/etc/nvmfd/nvmfd.toml"
    )]
    config: PathBuf,
    /// Validate this configuration file, print the verdict and exit (0 valid, 1 not).
    #[arg(long, value_name = "PATH", conflicts_with = "config")]
    check_config: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let facts = system_facts();
    if let Some(path) = cli.check_config {
        return match Config::load(&path, &facts) {
            Ok(cfg) => {
                for w in cfg.warnings() {
                    eprintln!("{}: warning: {w}", path.display());
                }
                let namespaces: usize = cfg.subsystems.iter().map(|s| s.namespaces.len()).sum();
                println!(
                    "{}: valid: {} listener(s), {} subsystem(s), {} namespace(s), {} reactor(s)",
                    path.display(),
                    cfg.listeners.len(),
                    cfg.subsystems.len(),
                    namespaces,
                    cfg.daemon.reactor_cores.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        };
    }
    let (cfg, text) = match Config::load_text(&cli.config, &facts) {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("nvmfd: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (level, level_warning) = logging::effective_level(cfg.daemon.log_level);
    let log = logging::build(level, cfg.daemon.log_format);
    if let Some(w) = level_warning {
        warn!(log, "{}", w);
    }
    info!(log, "nvmfd starting"; "version" => env!("CARGO_PKG_VERSION"),
          "config" => %cli.config.display(), "pid" => std::process::id());
    for w in cfg.warnings() {
        warn!(log, "configuration: {}", w);
    }
    if let Err(e) = nvmfd::datapath::raise_file_limit() {
        warn!(log, "cannot raise the open file limit to its hard limit: each reactor's engine serves at most 1,024 namespace devices at once"; "error" => %e);
    }
    // Read again on a reload, and written back after changes made while serving: by its
    // absolute path, whatever the working directory becomes. A symlink stays one (an operator
    // may point it at another file, then reload): it is resolved when the file is written.
    let path = std::path::absolute(&cli.config).unwrap_or_else(|_| cli.config.clone());
    let result = control::run(cfg, Some((path, text)), facts, log.clone());
    let code = match result {
        Ok(()) => {
            info!(log, "nvmfd stopped");
            0
        }
        Err(e) => {
            error!(log, "nvmfd failed"; "error" => %e);
            1
        }
    };
    // Work the control thread stopped waiting for (RBD handles opened ahead for a listener)
    // may still be inside librbd; its handles, and the rest, are closed on threads of their
    // own. The last of both end now.
    let end = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let running = control::off_thread_running();
    if running > 0 {
        info!(log, "waiting for operations off the control thread before exiting"; "operations" => running);
    }
    let settled =
        control::wait_off_thread(end.saturating_duration_since(std::time::Instant::now()))
            && nvmfd_blockdev::wait_for_rbd_closes(
                end.saturating_duration_since(std::time::Instant::now()),
            );
    let abandoned = nvmfd::reactor::reactors_abandoned();
    if abandoned > 0 {
        warn!(log, "reactor threads still setting up at exit are left to the process's end";
              "reactors" => abandoned);
    }
    if !settled || abandoned > 0 {
        if !settled {
            warn!(log, "RBD work still under way at exit: the cluster drops the images' watches when they time out";
                  "images_closing" => nvmfd_blockdev::rbd_closes_pending(),
                  "operations" => control::off_thread_running());
        }
        // Something is still inside librbd, or a reactor still setting up: leave without
        // running the libraries' destructors under it (the log is written synchronously, so
        // nothing is lost).
        // SAFETY: _exit ends the process at once; no Rust state needs to outlive it.
        unsafe { libc::_exit(code) };
    }
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
