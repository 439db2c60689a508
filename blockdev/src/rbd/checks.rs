//! What an image's handle is checked for when it opens: a configuration (the pool's or the
//! image's) that turns a write-back cache on, which nvmfd refuses; the exclusive-lock
//! feature, which it warns of. (Discard settings do not matter: a deallocate is a
//! `rbd_aio_write_zeroes`, which zeroes what it cannot discard whatever they say.)

use std::ffi::c_char;
use std::io;

use super::{err, ffi, lib, Image};

impl Image {
    /// This handle, if librbd acknowledges its writes only once they are on the OSDs and
    /// caches no reads. nvmfd turns librbd's cache off on its connection, but a pool's or an
    /// image's configuration (`rbd config pool|image set ... rbd_cache true`) overrides that
    /// at open. Such a handle could acknowledge writes it still holds, and the device reports
    /// no volatile cache; a Flush reaches only the cache of the handle it goes to; and a read
    /// cache is its handle's alone, while each reactor has its own handle (one reads back
    /// data another's write replaced). So it is refused, with what to change, unless the cache
    /// is librbd's write-around one with no dirty bytes (reads go around it, writes through).
    pub(super) fn writing_through(self, what: impl Fn() -> String) -> io::Result<Image> {
        if self.read_only {
            return Ok(self);
        }
        let config = self.config()?;
        let get = |k: &str| config.iter().find(|(n, _, _)| n == k);
        let where_set = |source: u32| match source {
            ffi::rbd_config_source_t_RBD_CONFIG_SOURCE_IMAGE => {
                "the image's configuration (rbd config image"
            }
            ffi::rbd_config_source_t_RBD_CONFIG_SOURCE_POOL => {
                "the pool's configuration (rbd config pool"
            }
            _ => "the client's configuration (ceph.conf or the monitors' config",
        };
        if let Some((_, v, source)) = get("rbd_cache") {
            let max_dirty = get("rbd_cache_max_dirty").map(|(_, d, _)| d.as_str());
            // librbd before Nautilus has no policy: its one cache is the ObjectCacher.
            let policy = get("rbd_cache_policy").map(|(_, p, _)| p.as_str());
            if let Some(why) = cache_refusal(v == "true", policy, max_dirty) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{} turns librbd's cache on (rbd_cache = true, set in {} ...); \
                         rbd_cache_policy = {}, rbd_cache_max_dirty = {}), {why}; remove the \
                         setting (rbd config image|pool rm ... rbd_cache), or make the cache \
                         write-around with no dirty bytes (rbd_cache_policy = writearound, \
                         rbd_cache_max_dirty = 0)",
                        what(),
                        where_set(*source),
                        policy.unwrap_or("(none)"),
                        max_dirty.unwrap_or("(none)"),
                    ),
                ));
            }
        }
        let plugins = get("rbd_plugins").map_or("", |(_, p, _)| p.as_str());
        let pwl = get("rbd_persistent_cache_mode").map_or("disabled", |(_, m, _)| m.as_str());
        if plugins.contains("pwl_cache") && pwl != "disabled" {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} turns librbd's persistent write-back cache on (rbd_plugins = \
                     {plugins}, rbd_persistent_cache_mode = {pwl}): writes would be \
                     acknowledged from a local log each reactor's handle keeps on its own; \
                     remove those settings",
                    what()
                ),
            ));
        }
        Ok(self)
    }

    /// The configuration this handle runs with: `(name, value, source)` of every option,
    /// the pool's and the image's overrides applied.
    fn config(&self) -> io::Result<Vec<(String, String, u32)>> {
        let mut max: i32 = 0;
        let mut options: Vec<ffi::rbd_config_option_t> = Vec::new();
        loop {
            options.resize_with(usize::try_from(max).unwrap_or(0), || {
                // SAFETY: a plain C struct of two pointers and an enum: all-zero is valid
                // (null pointers, source 0), and librbd overwrites it.
                unsafe { std::mem::zeroed() }
            });
            // SAFETY: an open handle; `options` has room for `max` entries, and librbd says
            // how many it needs (-ERANGE) when that is too few.
            let rc = unsafe {
                lib()
                    .rbd
                    .rbd_config_image_list(self.handle, options.as_mut_ptr(), &mut max)
            };
            if rc == -libc::ERANGE && usize::try_from(max).unwrap_or(0) > options.len() {
                continue;
            }
            if rc < 0 {
                return Err(err("rbd_config_image_list", rc));
            }
            break;
        }
        let n = usize::try_from(max).unwrap_or(0).min(options.len());
        let text = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                // SAFETY: a NUL-terminated string librbd allocated for this list, freed only
                // by the cleanup below.
                unsafe { std::ffi::CStr::from_ptr(p) }
                    .to_string_lossy()
                    .into_owned()
            }
        };
        let out = options[..n]
            .iter()
            .map(|o| (text(o.name), text(o.value), o.source))
            .collect();
        // SAFETY: the `max` entries librbd filled in, freed once.
        unsafe {
            lib()
                .rbd
                .rbd_config_image_list_cleanup(options.as_mut_ptr(), max)
        };
        Ok(out)
    }

    /// What to warn of when serving this image: exclusive-lock makes the reactors' handles
    /// (one per reactor) take the image's lock in turn, a round trip to the cluster each time
    /// another reactor writes.
    pub(crate) fn warning(&self) -> Option<String> {
        if self.read_only {
            return None;
        }
        let mut features = 0u64;
        // SAFETY: an open handle; `features` receives the value.
        let rc = unsafe { lib().rbd.rbd_get_features(self.handle, &mut features) };
        if rc < 0 || features & u64::from(ffi::RBD_FEATURE_EXCLUSIVE_LOCK) == 0 {
            return None;
        }
        Some(format!(
            "image `{}` has the exclusive-lock feature: each reactor's handle takes the lock \
             in turn, and writes wait for it to move between them (rbd feature disable \
             <pool>/{} exclusive-lock, with object-map, fast-diff and journaling if set)",
            self.name.to_string_lossy(),
            self.name.to_string_lossy()
        ))
    }
}

/// Why librbd's cache as configured (`rbd_cache` on, `rbd_cache_policy` and
/// `rbd_cache_max_dirty` as set, `None` where librbd has no such option) cannot serve a
/// namespace, if it cannot. Only `writearound` with no dirty bytes writes through and reads
/// around: the ObjectCacher (`writethrough`, `writeback`, and the one cache of a librbd
/// without policies) caches reads in each handle, and each reactor has its own, so one would
/// read back what another's write replaced; dirty bytes acknowledge writes early (but
/// `writethrough`, which takes none).
fn cache_refusal(on: bool, policy: Option<&str>, max_dirty: Option<&str>) -> Option<&'static str> {
    let dirty = max_dirty.is_some_and(|d| d != "0");
    if !on || (policy == Some("writearound") && !dirty) {
        None
    } else if dirty && policy != Some("writethrough") {
        Some("a write-back cache: writes would be acknowledged before they are on the OSDs")
    } else {
        Some(
            "a read cache in each handle: a reactor's handle would read back data another \
             reactor's write replaced",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::cache_refusal;

    #[test]
    fn only_a_write_around_cache_with_no_dirty_bytes_serves() {
        let read_cache = Some(
            "a read cache in each handle: a reactor's handle would read back data another \
             reactor's write replaced",
        );
        let write_back =
            Some("a write-back cache: writes would be acknowledged before they are on the OSDs");
        for (on, policy, dirty, want) in [
            (false, Some("writeback"), Some("25165824"), None),
            (true, Some("writearound"), Some("0"), None),
            (true, Some("writearound"), Some("25165824"), write_back),
            (true, Some("writeback"), Some("25165824"), write_back),
            (true, Some("writeback"), Some("0"), read_cache),
            (true, Some("writethrough"), Some("0"), read_cache),
            (true, Some("writethrough"), Some("25165824"), read_cache),
            (true, None, Some("0"), read_cache),
            (true, None, Some("25165824"), write_back),
        ] {
            assert_eq!(
                cache_refusal(on, policy, dirty),
                want,
                "rbd_cache {on}, policy {policy:?}, max_dirty {dirty:?}"
            );
        }
    }
}
