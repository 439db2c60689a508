//! nvmfd's configuration: the schema of `nvmfd.toml`, its defaults, and validation whose every
//! error names the key, the line and the column.
//!
//! ```
//! use nvmfd_config::{Config, SystemFacts};
//! let facts = SystemFacts { allowed_cores: vec![0, 1] };
//! let cfg = Config::parse(r#"
//!     [[listener]]
//!     address = "127.0.0.1"
//!     provider = "soft"
//! "#, &facts).unwrap();
//! assert_eq!(cfg.listeners[0].port, 4420);
//! ```

mod edit;
mod error;
mod schema;
mod units;
mod validate;

use std::path::Path;

pub use edit::{document, sockaddr, Edit};
pub use error::{ConfigError, ConfigErrors, KeyPath, Seg};
pub use schema::*;
pub use units::{ByteSize, ByteSizeError, HumanDuration};
pub use validate::{
    check_nqn, nqn_form, SystemFacts, DISCOVERY_NQN, IN_CAPSULE_MAX, MAX_NAMESPACES, NQN_MAX_BYTES,
};

/// Why a configuration file could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// the file could not be read
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// the file has errors
    #[error("{0}")]
    Invalid(#[from] ConfigErrors),
}

impl Config {
    /// Reads, parses and validates the configuration file at `path`.
    pub fn load(path: &Path, facts: &SystemFacts) -> Result<Config, LoadError> {
        Config::load_text(path, facts).map(|(cfg, _)| cfg)
    }

    /// [`Config::load`], with the text read: what the configuration came from, for edits
    /// made to it later (the file may have changed since, and must not be read again).
    pub fn load_text(path: &Path, facts: &SystemFacts) -> Result<(Config, String), LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
            path: path.to_owned(),
            source,
        })?;
        let cfg = Config::parse(&text, facts).map_err(|mut e| {
            for err in &mut e.0 {
                err.file = Some(path.to_owned());
            }
            LoadError::Invalid(e)
        })?;
        Ok((cfg, text))
    }

    /// Parses and validates configuration text.
    pub fn parse(text: &str, facts: &SystemFacts) -> Result<Config, ConfigErrors> {
        let error_at = |doc: Option<&serde_spanned::Spanned<toml::de::DeTable<'_>>>,
                        span: std::ops::Range<usize>,
                        key: KeyPath,
                        message: String| {
            let key = match (key.0.is_empty(), doc) {
                (true, Some(doc)) => error::path_at(doc, span.start),
                _ => key,
            };
            let (line, column) = error::line_col(text, span.start);
            ConfigError {
                file: None,
                key: key.to_string(),
                line,
                column,
                message,
            }
        };
        let doc = match toml::de::DeTable::parse(text) {
            Ok(doc) => doc,
            Err(e) => {
                let span = e.span().unwrap_or(0..0);
                return Err(ConfigErrors(vec![error_at(
                    None,
                    span,
                    KeyPath::default(),
                    format!("TOML syntax: {}", e.message().trim_end()),
                )]));
            }
        };
        let cfg: Config = match toml::from_str(text) {
            Ok(cfg) => cfg,
            Err(e) => {
                let span = e.span().unwrap_or(0..0);
                return Err(ConfigErrors(vec![error_at(
                    Some(&doc),
                    span,
                    KeyPath::default(),
                    e.message().trim_end().to_owned(),
                )]));
            }
        };
        let problems = validate::validate(&cfg, facts);
        if problems.is_empty() {
            return Ok(cfg);
        }
        let mut errors: Vec<ConfigError> = problems
            .into_iter()
            .map(|p| {
                let span = error::span_of(&doc, &p.path);
                let (line, column) = error::line_col(text, span.start);
                ConfigError {
                    file: None,
                    key: p.path.to_string(),
                    line,
                    column,
                    message: p.message,
                }
            })
            .collect();
        errors.sort_by_key(|e| (e.line, e.column));
        Err(ConfigErrors(errors))
    }
}

impl Config {
    /// What the configuration holds that is accepted but deserves a warning, one line each
    /// with its key (`subsystem[0].nqn: ...`): NQNs outside the specification's form.
    /// `nvmfd --check-config` prints them and the daemon logs them at start.
    pub fn warnings(&self) -> Vec<String> {
        validate::warnings(self)
            .into_iter()
            .map(|p| format!("{}: {}", p.path, p.message))
            .collect()
    }
}

impl Subsystem {
    /// The serial number reported to hosts: the configured one, or 20 hex digits derived from
    /// the NQN (FNV-1a), stable across restarts.
    pub fn serial_number(&self) -> String {
        if let Some(s) = &self.serial {
            return s.clone();
        }
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.nqn.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // 16 hex digits of the hash, then 4 of the hash of the hash.
        let h2 = (h ^ (h >> 29)).wrapping_mul(0x0100_0000_01b3);
        format!("{h:016x}{:04x}", h2 >> 48)
    }
}
