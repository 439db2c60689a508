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
    /// Writes the configuration file: a new file beside it (a name of its own, created
    /// exclusively: nothing planted at a known name is followed), synced, renamed over it.
    /// Where the configuration's path is a symlink, the file it names now is the one written
    /// (the link stays); the new file keeps the old one's permissions, and its owner and
    /// group where the daemon may set them.
    pub(super) fn write_config(&self, text: &str) -> Result<(), String> {
        let Some(given) = &self.source.path else {
            return Ok(());
        };
        let resolved = std::fs::canonicalize(given).unwrap_or_else(|_| given.clone());
        let path = &resolved;
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(std::path::Path::new("."));
        let write = || -> std::io::Result<()> {
            use std::io::Write;
            use std::os::unix::fs::MetadataExt;
            let mut tmp = tempfile::Builder::new()
                .prefix(".nvmfd-config-")
                .suffix(".new")
                .tempfile_in(dir)?;
            if let Ok(meta) = std::fs::metadata(path) {
                tmp.as_file().set_permissions(meta.permissions())?;
                if let Err(e) =
                    std::os::unix::fs::fchown(tmp.as_file(), Some(meta.uid()), Some(meta.gid()))
                {
                    warn!(self.log, "the configuration file's owner and group could not be kept";
                          "path" => %path.display(), "error" => %e);
                }
            }
            tmp.write_all(text.as_bytes())?;
            tmp.as_file().sync_all()?;
            // On an error the new file is removed as `tmp` drops.
            tmp.persist(path).map_err(|e| e.error)?;
            std::fs::File::open(dir)?.sync_all()?;
            Ok(())
        };
        write().map_err(|e| format!("cannot write the configuration to {}: {e}", path.display()))
    }
}
