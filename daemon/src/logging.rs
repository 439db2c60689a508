//! Logging with slog: human-readable on a terminal, one JSON object per line otherwise.

use std::io::IsTerminal;
use std::sync::Mutex;

use nvmfd_config::{LogFormat, LogLevel};
use slog::{o, Drain, Logger};

/// Environment variable that overrides the configured log level.
pub const LOG_ENV: &str = "NVMFD_LOG";

/// The level to log at: `NVMFD_LOG` when it is set and valid, else the configured one. A bad
/// `NVMFD_LOG` is reported in the returned warning instead of being ignored silently.
pub fn effective_level(configured: LogLevel) -> (LogLevel, Option<String>) {
    match std::env::var(LOG_ENV) {
        Ok(v) if !v.trim().is_empty() => match v.parse() {
            Ok(l) => (l, None),
            Err(e) => (configured, Some(format!("{LOG_ENV} ignored: {e}"))),
        },
        _ => (configured, None),
    }
}

fn slog_level(l: LogLevel) -> slog::Level {
    match l {
        LogLevel::Error => slog::Level::Error,
        LogLevel::Warn => slog::Level::Warning,
        LogLevel::Info => slog::Level::Info,
        LogLevel::Debug => slog::Level::Debug,
        LogLevel::Trace => slog::Level::Trace,
    }
}

/// Builds the root logger, writing to standard error.
///
/// Lines are written synchronously under a mutex: the data path logs only rare events, and a
/// synchronous drain loses nothing when the daemon exits. Every level is compiled in (slog's
/// `max_level_trace` and `release_max_level_trace`), so the level is checked here, before the
/// lock: a line below it costs a comparison.
///
/// Its first line, at debug level, says how it logs: a debug line every build and
/// configuration prints as soon as `NVMFD_LOG=debug` asks for them.
pub fn build(level: LogLevel, format: LogFormat) -> Logger {
    let human = match format {
        LogFormat::Auto => std::io::stderr().is_terminal(),
        LogFormat::Human => true,
        LogFormat::Json => false,
    };
    let log = root(slog_level(level), human);
    slog::debug!(log, "logging"; "level" => ?level, "format" => if human { "human" } else { "json" });
    log
}

fn root(level: slog::Level, human: bool) -> Logger {
    if human {
        let decorator = slog_term::TermDecorator::new().stderr().build();
        let drain = slog_term::FullFormat::new(decorator).build();
        let drain = Mutex::new(drain).filter_level(level).ignore_res();
        Logger::root(drain, o!())
    } else {
        let drain = slog_json::Json::new(std::io::stderr())
            .add_key_value(o!(
                "ts" => slog::PushFnValue(|_, ser| {
                    ser.emit(humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string())
                }),
                "level" => slog::FnValue(|r| r.level().as_short_str()),
                "msg" => slog::PushFnValue(|r, ser| ser.emit(r.msg())),
            ))
            .build();
        let drain = Mutex::new(drain).filter_level(level).ignore_res();
        Logger::root(drain, o!())
    }
}
