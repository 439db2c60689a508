//! With the `rbd` feature: bindings to librados and librbd, generated from the headers of the
//! system's `librbd-dev` (Debian 12: Ceph 16). They load the libraries when the first RBD
//! image is opened (`librados.so.2`, `librbd.so.1`), so nvmfd starts, and serves its other
//! namespaces, on machines without them.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "rbd")]
    rbd();
}

#[cfg(feature = "rbd")]
fn rbd() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let generate = |lib: &str, functions: &str, vars: &str, file: &str| {
        bindgen::Builder::default()
            .header_contents(
                "rbd_wrapper.h",
                "#include <rados/librados.h>\n#include <rbd/librbd.h>\n",
            )
            .allowlist_function(functions)
            .allowlist_var(vars)
            .dynamic_library_name(lib)
            .dynamic_link_require_all(true)
            .layout_tests(false)
            .generate()
            .unwrap_or_else(|()| {
                panic!(
                    "cannot generate the {lib} bindings; install librbd-dev \
                     (scripts/install-deps.sh does), or build without the `rbd` feature"
                )
            })
            .write_to_file(out.join(file))
            .expect("write the bindings");
    };
    generate(
        "Rados",
        "rados_(create|conf_read_file|conf_set|conf_get|connect|shutdown|ioctx_create|ioctx_destroy|ioctx_set_namespace|cluster_fsid|ioctx_get_id)",
        "NONE",
        "rados_bindings.rs",
    );
    generate(
        "Rbd",
        "rbd_(open|open_read_only|close|create2|get_size|set_image_notification|poll_io_events|aio_create_completion|aio_get_return_value|aio_get_arg|aio_release|aio_read|aio_write|aio_flush|aio_discard|aio_write_zeroes|resize|resize_with_progress|get_features|config_image_list|config_image_list_cleanup|update_watch|update_unwatch|get_id)",
        "RBD_FEATURE_LAYERING|RBD_FEATURE_EXCLUSIVE_LOCK|EVENT_TYPE_EVENTFD",
        "rbd_bindings.rs",
    );
}
