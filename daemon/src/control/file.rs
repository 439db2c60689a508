//! The configuration file: where the configuration in force came from, and writing it back.

use std::path::PathBuf;

use super::*;

/// Where the configuration in force came from, and its text (what edits apply to).
#[derive(Debug)]
pub(super) struct Source {
    /// The configuration file, written back after each change made by a request.
    pub(super) path: Option<PathBuf>,
    /// Its text as last read or written.
    pub(super) text: String,
    /// What validation checks the cores against.
    pub(super) facts: nvmfd_config::SystemFacts,
}

impl Daemon {
    /// Writes the configuration file: a new file beside it, synced, renamed over it. Where the
    /// configuration's path is a symlink, the file it names now is the one written (the link
    /// stays); the new file keeps the old one's permissions, and its owner and group where
    /// the daemon may set them.
    pub(super) fn write_config(&self, text: &str) -> Result<(), String> {
        let Some(given) = &self.source.path else {
            return Ok(());
        };
        let resolved = std::fs::canonicalize(given).unwrap_or_else(|_| given.clone());
        let path = &resolved;
        let tmp = path.with_extension("toml.new");
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            use std::os::unix::fs::MetadataExt;
            let mut f = std::fs::File::create(&tmp)?;
            if let Ok(meta) = std::fs::metadata(path) {
                f.set_permissions(meta.permissions())?;
                if let Err(e) = std::os::unix::fs::fchown(&f, Some(meta.uid()), Some(meta.gid())) {
                    warn!(self.log, "the configuration file's owner and group could not be kept";
                          "path" => %path.display(), "error" => %e);
                }
            }
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, path)?;
            let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
            std::fs::File::open(dir.unwrap_or(std::path::Path::new(".")))?.sync_all()?;
            Ok(())
        };
        write().map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot write the configuration to {}: {e}", path.display())
        })
    }
}
