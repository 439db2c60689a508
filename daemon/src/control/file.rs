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
    /// group where the daemon may set them. Once renamed over it, the file holds the text:
    /// the written text is in force (Ok) even where the directory's sync then fails, which
    /// is logged (a crash may bring the old file back).
    pub(super) fn write_config(&self, text: &str) -> Result<(), String> {
        let Some(given) = &self.source.path else {
            return Ok(());
        };
        let resolved = std::fs::canonicalize(given).unwrap_or_else(|_| given.clone());
        replace_file(&resolved, text, &self.log, |dir| {
            std::fs::File::open(dir)?.sync_all()
        })
    }
}

/// Replaces `path`'s contents with `text` (see [`Daemon::write_config`]); `sync_dir` syncs
/// the directory after the rename.
fn replace_file(
    path: &std::path::Path,
    text: &str,
    log: &slog::Logger,
    sync_dir: impl FnOnce(&std::path::Path) -> std::io::Result<()>,
) -> Result<(), String> {
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
                warn!(log, "the configuration file's owner and group could not be kept";
                      "path" => %path.display(), "error" => %e);
            }
        }
        tmp.write_all(text.as_bytes())?;
        tmp.as_file().sync_all()?;
        // On an error the new file is removed as `tmp` drops.
        tmp.persist(path).map_err(|e| e.error)?;
        Ok(())
    };
    write().map_err(|e| format!("cannot write the configuration to {}: {e}", path.display()))?;
    // Renamed: the file holds `text` now, whatever the directory's sync says. Reported as
    // not written, the change would be undone in the daemon while the file kept it (and the
    // next reload applied it), and every later change refused as the file edited since.
    if let Err(e) = sync_dir(dir) {
        warn!(log, "the configuration file was written but its directory could not be synced: a crash may bring back the file of before";
              "path" => %path.display(), "error" => %e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory sync failing after the rename: the file holds the new text, and the write
    /// is reported done (before, it was reported failed, and the change undone in the daemon
    /// while the file kept it).
    #[test]
    fn a_write_renamed_over_the_file_is_done_though_the_directory_sync_fails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nvmfd.toml");
        std::fs::write(&path, "old").unwrap();
        let log = slog::Logger::root(slog::Discard, slog::o!());
        let failing = |_: &std::path::Path| Err(std::io::Error::from_raw_os_error(libc::EIO));
        assert_eq!(replace_file(&path, "new", &log, failing), Ok(()));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "new");
        // A rename that fails (over a directory that is not empty) is refused: what was
        // there stays, and the new file beside it is removed.
        let taken = dir.path().join("taken");
        std::fs::create_dir(&taken).unwrap();
        std::fs::write(taken.join("kept"), "kept").unwrap();
        assert!(replace_file(&taken, "new", &log, |_| Ok(())).is_err());
        assert_eq!(std::fs::read_to_string(taken.join("kept")).unwrap(), "kept");
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["nvmfd.toml", "taken"], "a new file was left behind");
    }
}
