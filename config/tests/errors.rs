//! One test per configuration error: each checks the key, the line, the column and the message.

use nvmfd_config::{Config, ConfigError, SystemFacts};

fn facts() -> SystemFacts {
    SystemFacts {
        allowed_cores: vec![0, 1, 2, 3],
    }
}

const LISTENER: &str = "[[listener]]\naddress = \"127.0.0.1\"\nprovider = \"soft\"\n";

/// Parses `text` and returns its single error.
fn one_error(text: &str) -> ConfigError {
    match Config::parse(text, &facts()) {
        Ok(_) => panic!("expected an error in:\n{text}"),
        Err(e) => {
            assert_eq!(e.0.len(), 1, "expected exactly one error, got:\n{e}");
            e.0.into_iter().next().unwrap()
        }
    }
}

/// Declares a test: the TOML, then the key, line, column and a fragment of the message.
macro_rules! error_case {
    ($name:ident, $text:expr, $key:expr, $line:expr, $col:expr, $msg:expr) => {
        #[test]
        fn $name() {
            let text: String = $text;
            let e = one_error(&text);
            assert_eq!(
                (e.key.as_str(), e.line, e.column),
                ($key, $line, $col),
                "wrong location for: {e}\nin:\n{text}"
            );
            assert!(
                e.message.contains($msg),
                "message `{}` lacks `{}`",
                e.message,
                $msg
            );
        }
    };
}

fn with_listener(rest: &str) -> String {
    format!("{LISTENER}{rest}")
}

fn subsystem(extra: &str) -> String {
    with_listener(&format!(
        "[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\nallow_any_host = true\n{extra}"
    ))
}

fn namespace(ns: &str) -> String {
    subsystem(&format!("[[subsystem.namespace]]\n{ns}"))
}

// Lines of `subsystem(..)`: 1-3 listener, 4 [[subsystem]], 5 nqn, 6 allow_any_host, 7.. extra.
// Lines of `namespace(..)`: 7 [[subsystem.namespace]], 8.. the namespace's keys.

error_case!(
    syntax_error,
    with_listener("[daemon\n"),
    "",
    4,
    8,
    "TOML syntax"
);
error_case!(
    unknown_top_level_table,
    with_listener("[deamon]\n"),
    "deamon",
    4,
    2,
    "unknown field `deamon`"
);
error_case!(
    unknown_key,
    with_listener("[daemon]\nreactor_core = [0]\n"),
    "daemon.reactor_core",
    5,
    1,
    "unknown field `reactor_core`"
);
error_case!(
    unknown_namespace_key,
    namespace("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nreadonly = true\n"),
    "subsystem[0].namespace[0].readonly",
    11,
    1,
    "unknown field `readonly`"
);
error_case!(
    wrong_type,
    with_listener("[transport]\nmax_queue_depth = \"lots\"\n"),
    "transport.max_queue_depth",
    5,
    19,
    "invalid type"
);
error_case!(
    bad_size_unit,
    with_listener("[transport]\nmax_io_size = \"128KB\"\n"),
    "transport.max_io_size",
    5,
    15,
    "\"128KiB\""
);
error_case!(
    max_io_size_below_what_mdts_can_say,
    with_listener("[transport]\nmax_io_size = \"4KiB\"\n"),
    "transport.max_io_size",
    5,
    1,
    "4KiB is not a power of two from 8KiB to 8MiB"
);
error_case!(
    bad_size_syntax,
    with_listener("[transport]\nmax_io_size = \"lots\"\n"),
    "transport.max_io_size",
    5,
    15,
    "is not a size"
);
error_case!(
    bad_duration,
    with_listener("[transport]\nkeep_alive_timeout_max = \"5 fortnights\"\n"),
    "transport.keep_alive_timeout_max",
    5,
    26,
    "is not a duration"
);
error_case!(
    bad_log_level,
    with_listener("[daemon]\nlog_level = \"loud\"\n"),
    "daemon.log_level",
    5,
    13,
    "unknown variant `loud`"
);
error_case!(
    bad_provider,
    "[[listener]]\naddress = \"127.0.0.1\"\nprovider = \"tcp\"\n".into(),
    "listener[0].provider",
    3,
    12,
    "unknown variant `tcp`"
);
error_case!(
    bad_address,
    "[[listener]]\naddress = \"10.0.0.300\"\n".into(),
    "listener[0].address",
    2,
    11,
    "invalid"
);
error_case!(
    listener_on_no_interface,
    "[[listener]]\naddress = \"0.0.0.0\"\nprovider = \"soft\"\n".into(),
    "listener[0].address",
    2,
    1,
    "listens on no interface in particular"
);
error_case!(
    listener_on_no_ipv6_interface,
    "[[listener]]\naddress = \"::\"\nprovider = \"soft\"\n".into(),
    "listener[0].address",
    2,
    1,
    "listens on no interface in particular"
);
error_case!(
    listener_twice_as_ipv4_mapped,
    "[[listener]]\naddress = \"10.0.0.1\"\nprovider = \"soft\"\n\
     [[listener]]\naddress = \"::ffff:10.0.0.1\"\nprovider = \"soft\"\n"
        .into(),
    "listener[1]",
    4,
    1,
    "duplicate listener"
);
error_case!(
    srq_max_below_queue_depth,
    with_listener(
        "[transport]\nsrq_max = 16\nsrq_initial = 16\nsrq_low_watermark = 4\nsrq_grow_chunk = 16\n"
    ),
    "transport.srq_max",
    5,
    1,
    "below max_queue_depth"
);
error_case!(
    missing_listener_address,
    "[[listener]]\nport = 4420\n".into(),
    "listener[0]",
    1,
    1,
    "missing field `address`"
);
error_case!(
    no_listener,
    "[daemon]\nreactor_cores = [0]\n".into(),
    "",
    1,
    1,
    "no [[listener]]"
);
error_case!(
    port_zero,
    "[[listener]]\naddress = \"127.0.0.1\"\nport = 0\n".into(),
    "listener[0].port",
    3,
    1,
    "port 0"
);
error_case!(
    duplicate_listener,
    format!("{LISTENER}{LISTENER}"),
    "listener[1]",
    4,
    1,
    "duplicate listener 127.0.0.1:4420 (soft)"
);
error_case!(
    no_reactor_cores,
    with_listener("[daemon]\nreactor_cores = []\n"),
    "daemon.reactor_cores",
    5,
    1,
    "at least one reactor core"
);
error_case!(
    duplicate_core,
    with_listener("[daemon]\nreactor_cores = [1, 1]\n"),
    "daemon.reactor_cores[1]",
    5,
    21,
    "listed twice"
);
error_case!(
    core_does_not_exist,
    with_listener("[daemon]\nreactor_cores = [0, 64]\n"),
    "daemon.reactor_cores[1]",
    5,
    21,
    "core 64 does not exist"
);
error_case!(
    relative_admin_socket,
    with_listener("[daemon]\nadmin_socket = \"nvmfd.sock\"\n"),
    "daemon.admin_socket",
    5,
    1,
    "not an absolute path"
);
error_case!(
    long_admin_socket,
    with_listener(&format!(
        "[daemon]\nadmin_socket = \"/{}\"\n",
        "s".repeat(120)
    )),
    "daemon.admin_socket",
    5,
    1,
    "shorter than 108"
);
error_case!(
    zero_stall_timeout,
    with_listener("[daemon]\nstall_timeout = \"0s\"\n"),
    "daemon.stall_timeout",
    5,
    1,
    "longer than zero"
);
error_case!(
    zero_admin_client_timeout,
    with_listener("[daemon]\nadmin_client_timeout = \"0s\"\n"),
    "daemon.admin_client_timeout",
    5,
    1,
    "longer than zero"
);
error_case!(
    queue_depth_too_small,
    with_listener("[transport]\nmax_queue_depth = 1\n"),
    "transport.max_queue_depth",
    5,
    1,
    "outside 32..=1024"
);
error_case!(
    queue_depth_below_the_admin_queue_hosts_open,
    with_listener("[transport]\nmax_queue_depth = 16\n"),
    "transport.max_queue_depth",
    5,
    1,
    "16 is outside 32..=1024"
);
error_case!(
    queue_depth_too_large,
    with_listener("[transport]\nmax_queue_depth = 4096\n"),
    "transport.max_queue_depth",
    5,
    1,
    "outside 32..=1024"
);
error_case!(
    io_queues_zero,
    with_listener("[transport]\nmax_io_queues = 0\n"),
    "transport.max_io_queues",
    5,
    1,
    "outside 1..=1024"
);
error_case!(
    in_capsule_not_multiple_of_16,
    with_listener("[transport]\nin_capsule_data_size = 1000\n"),
    "transport.in_capsule_data_size",
    5,
    1,
    "not a multiple of 16"
);
error_case!(
    in_capsule_above_limit,
    with_listener("[transport]\nin_capsule_data_size = \"32KiB\"\n"),
    "transport.in_capsule_data_size",
    5,
    1,
    "above the limit of 16KiB"
);
error_case!(
    in_capsule_above_max_io,
    with_listener("[transport]\nin_capsule_data_size = \"16KiB\"\nmax_io_size = \"8KiB\"\n"),
    "transport.in_capsule_data_size",
    5,
    1,
    "larger than max_io_size"
);
error_case!(
    max_io_not_power_of_two,
    with_listener("[transport]\nmax_io_size = \"96KiB\"\n"),
    "transport.max_io_size",
    5,
    1,
    "not a power of two"
);
error_case!(
    max_io_too_large,
    with_listener("[transport]\nmax_io_size = \"16MiB\"\n"),
    "transport.max_io_size",
    5,
    1,
    "not a power of two from 8KiB to 8MiB"
);
error_case!(
    srq_watermark_above_initial,
    with_listener("[transport]\nsrq_initial = 64\nsrq_low_watermark = 64\n"),
    "transport.srq_low_watermark",
    6,
    1,
    "must be below srq_initial"
);
error_case!(
    srq_initial_above_max,
    with_listener("[transport]\nsrq_initial = 8192\nsrq_max = 4096\n"),
    "transport.srq_initial",
    5,
    1,
    "above srq_max"
);
error_case!(
    srq_initial_zero,
    with_listener("[transport]\nsrq_initial = 0\n"),
    "transport.srq_initial",
    5,
    1,
    "at least one receive"
);
error_case!(
    srq_max_too_large,
    with_listener("[transport]\nsrq_max = 4194304\n"),
    "transport.srq_max",
    5,
    1,
    "outside 1..=1048576"
);
error_case!(
    srq_shrink_delay_too_short,
    with_listener("[transport]\nsrq_shrink_delay = \"1ms\"\n"),
    "transport.srq_shrink_delay",
    5,
    1,
    "outside 10ms..=1h"
);
error_case!(
    connect_timeout_too_long,
    with_listener("[transport]\nconnect_timeout = \"2h\"\n"),
    "transport.connect_timeout",
    5,
    1,
    "outside 10ms..=1h"
);
error_case!(
    srq_grow_chunk_zero,
    with_listener("[transport]\nsrq_grow_chunk = 0\n"),
    "transport.srq_grow_chunk",
    5,
    1,
    "outside 1..=srq_max"
);
error_case!(
    keep_alive_min_zero,
    with_listener("[transport]\nkeep_alive_timeout_min = \"0s\"\n"),
    "transport.keep_alive_timeout_min",
    5,
    1,
    "longer than zero"
);
error_case!(
    keep_alive_min_above_max,
    with_listener(
        "[transport]\nkeep_alive_timeout_min = \"10s\"\nkeep_alive_timeout_max = \"5s\"\n"
    ),
    "transport.keep_alive_timeout_max",
    6,
    1,
    "shorter than keep_alive_timeout_min"
);
error_case!(
    nqn_with_space,
    with_listener("[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a b\"\nallow_any_host = true\n"),
    "subsystem[0].nqn",
    5,
    1,
    "spaces"
);
error_case!(
    nqn_too_long,
    with_listener(&format!(
        "[[subsystem]]\nnqn = \"nqn.2024-01.com.example:{}\"\nallow_any_host = true\n",
        "x".repeat(200)
    )),
    "subsystem[0].nqn",
    5,
    1,
    "at most 223 bytes"
);
error_case!(
    nqn_is_discovery,
    with_listener(
        "[[subsystem]]\nnqn = \"nqn.2014-08.org.nvmexpress.discovery\"\nallow_any_host = true\n"
    ),
    "subsystem[0].nqn",
    5,
    1,
    "discovery subsystem"
);
error_case!(
    duplicate_nqn,
    subsystem("[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\nallow_any_host = true\n"),
    "subsystem[1].nqn",
    8,
    1,
    "already subsystem[0]'s NQN"
);
error_case!(
    missing_nqn,
    with_listener("[[subsystem]]\nallow_any_host = true\n"),
    "subsystem[0]",
    4,
    1,
    "missing field `nqn`"
);
error_case!(
    serial_too_long,
    subsystem("serial = \"123456789012345678901\"\n"),
    "subsystem[0].serial",
    7,
    1,
    "1 to 20 printable ASCII"
);
error_case!(
    cntlid_min_zero,
    subsystem("cntlid_min = 0\n"),
    "subsystem[0].cntlid_min",
    7,
    1,
    "a controller ID is 1 to 65519"
);
error_case!(
    cntlid_max_past_ffef,
    subsystem("cntlid_max = 65520\n"),
    "subsystem[0].cntlid_max",
    7,
    1,
    "a controller ID is 1 to 65519"
);
error_case!(
    cntlid_range_empty,
    subsystem("cntlid_min = 200\ncntlid_max = 100\n"),
    "subsystem[0].cntlid_max",
    8,
    1,
    "below cntlid_min (200)"
);
error_case!(
    serial_and_model_of_another_subsystem,
    subsystem(
        "serial = \"SN1\"\n[[subsystem]]\nnqn = \"nqn.2024-01.com.example:b\"\nallow_any_host = true\nserial = \"SN1\"\n"
    ),
    "subsystem[1].serial",
    11,
    1,
    "subsystem[0] has the same serial number and model"
);
error_case!(
    model_not_ascii,
    subsystem("model = \"Modèle\"\n"),
    "subsystem[0].model",
    7,
    1,
    "1 to 40 printable ASCII"
);
error_case!(
    no_host_allowed,
    with_listener("[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\n"),
    "subsystem[0]",
    4,
    1,
    "no host may connect"
);
error_case!(
    any_host_and_hosts,
    subsystem("hosts = [\"nqn.2024-01.com.example:h\"]\n"),
    "subsystem[0].hosts",
    7,
    1,
    "admits every host"
);
error_case!(bad_host_nqn, with_listener("[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\nhosts = [\"nqn.2024-01.com.example:h\", \"host 1\"]\n"), "subsystem[0].hosts[1]", 6, 39, "spaces");
error_case!(duplicate_host_nqn, with_listener("[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\nhosts = [\"nqn.2024-01.com.example:h\", \"nqn.2024-01.com.example:h\"]\n"), "subsystem[0].hosts[1]", 6, 39, "listed twice");
error_case!(
    nsid_zero,
    namespace("nsid = 0\nbackend = \"null\"\nsize = \"1MiB\"\n"),
    "subsystem[0].namespace[0].nsid",
    8,
    1,
    "not a valid namespace ID"
);
error_case!(
    nsid_broadcast,
    namespace("nsid = 4294967295\nbackend = \"null\"\nsize = \"1MiB\"\n"),
    "subsystem[0].namespace[0].nsid",
    8,
    1,
    "not a valid namespace ID"
);
error_case!(duplicate_nsid, namespace("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\n[[subsystem.namespace]]\nnsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\n"), "subsystem[0].namespace[1].nsid", 12, 1, "already namespace[0]");
error_case!(
    missing_backend,
    namespace("nsid = 1\n"),
    "subsystem[0].namespace[0]",
    7,
    1,
    "missing field `backend`"
);
error_case!(
    unknown_backend,
    namespace("nsid = 1\nbackend = \"nvme\"\n"),
    "subsystem[0].namespace[0].backend",
    9,
    11,
    "unknown variant `nvme`"
);
error_case!(
    file_without_path,
    namespace("nsid = 1\nbackend = \"file\"\n"),
    "subsystem[0].namespace[0]",
    7,
    1,
    "needs a `path`"
);
error_case!(
    file_relative_path,
    namespace("nsid = 1\nbackend = \"file\"\npath = \"disk.img\"\n"),
    "subsystem[0].namespace[0].path",
    10,
    1,
    "not an absolute path"
);
error_case!(
    file_with_size,
    namespace("nsid = 1\nbackend = \"file\"\npath = \"/var/lib/disk.img\"\nsize = \"1GiB\"\n"),
    "subsystem[0].namespace[0].size",
    11,
    1,
    "remove `size`"
);
error_case!(
    malloc_without_size,
    namespace("nsid = 1\nbackend = \"malloc\"\n"),
    "subsystem[0].namespace[0]",
    7,
    1,
    "needs a `size`"
);
error_case!(
    malloc_with_path,
    namespace("nsid = 1\nbackend = \"malloc\"\nsize = \"1MiB\"\npath = \"/dev/zero\"\n"),
    "subsystem[0].namespace[0].path",
    11,
    1,
    "has no `path`"
);
error_case!(
    size_zero,
    namespace("nsid = 1\nbackend = \"malloc\"\nsize = 0\n"),
    "subsystem[0].namespace[0].size",
    10,
    1,
    "cannot be empty"
);
error_case!(
    size_not_whole_blocks,
    namespace("nsid = 1\nbackend = \"malloc\"\nsize = \"6KiB\"\nblock_size = 4096\n"),
    "subsystem[0].namespace[0].size",
    10,
    1,
    "whole number of 4096-byte blocks"
);
error_case!(
    bad_block_size,
    namespace("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nblock_size = 1024\n"),
    "subsystem[0].namespace[0].block_size",
    11,
    1,
    "not 512 or 4096"
);
error_case!(
    bdev_with_block_size,
    namespace("nsid = 1\nbackend = \"bdev\"\npath = \"/dev/sdb\"\nblock_size = 4096\n"),
    "subsystem[0].namespace[0].block_size",
    11,
    1,
    "reports its own"
);
error_case!(
    bad_uuid,
    namespace("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nuuid = \"xyz\"\n"),
    "subsystem[0].namespace[0].uuid",
    11,
    8,
    "UUID"
);
error_case!(nil_uuid, namespace("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nuuid = \"00000000-0000-0000-0000-000000000000\"\n"), "subsystem[0].namespace[0].uuid", 11, 1, "nil UUID");
error_case!(duplicate_uuid, namespace("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nuuid = \"6c61622d-0000-4000-8000-000000000001\"\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"null\"\nsize = \"1MiB\"\nuuid = \"6c61622d-0000-4000-8000-000000000001\"\n"), "subsystem[0].namespace[1].uuid", 16, 1, "already subsystem[0].namespace[0]'s");
error_case!(
    bad_nguid,
    namespace("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nnguid = \"1234\"\n"),
    "subsystem[0].namespace[0].nguid",
    11,
    1,
    "not 32 hex digits"
);
error_case!(
    zero_nguid,
    namespace(&format!(
        "nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nnguid = \"{}\"\n",
        "0".repeat(32)
    )),
    "subsystem[0].namespace[0].nguid",
    11,
    1,
    "all-zero"
);
error_case!(duplicate_nguid, namespace(&format!("nsid = 1\nbackend = \"null\"\nsize = \"1MiB\"\nnguid = \"{g}\"\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"null\"\nsize = \"1MiB\"\nnguid = \"{g}\"\n", g = "ab".repeat(16))), "subsystem[0].namespace[1].nguid", 16, 1, "already subsystem[0].namespace[0]'s");
error_case!(duplicate_backing_path, namespace("nsid = 1\nbackend = \"file\"\npath = \"/srv/a.img\"\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"file\"\npath = \"/srv/a.img\"\n"), "subsystem[0].namespace[1].path", 14, 1, "already backs subsystem[0].namespace[0]");

#[test]
fn several_errors_are_all_reported_in_file_order() {
    let text = with_listener("[transport]\nmax_queue_depth = 1\nin_capsule_data_size = 100\n");
    let e = Config::parse(&text, &facts()).unwrap_err();
    let keys: Vec<_> = e.0.iter().map(|e| (e.key.as_str(), e.line)).collect();
    assert_eq!(
        keys,
        [
            ("transport.max_queue_depth", 5),
            ("transport.in_capsule_data_size", 6)
        ]
    );
}

#[test]
fn load_names_the_file_and_read_errors_name_the_path() {
    let dir = std::env::temp_dir().join(format!("nvmfd-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, "[[listener]]\naddress = \"127.0.0.1\"\nport = 0\n").unwrap();
    let e = Config::load(&path, &facts()).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}:3:1: `listener[0].port`: port 0 is not a port to listen on",
            path.display()
        )
    );
    let missing = dir.join("missing.toml");
    let e = Config::load(&missing, &facts()).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("cannot read {}: ", missing.display())),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
error_case!(
    max_nsid_zero,
    with_listener("[transport]\nmax_nsid = 0\n"),
    "transport.max_nsid",
    5,
    1,
    "outside 1..=4294967294"
);
error_case!(
    nsid_above_max_nsid,
    namespace("nsid = 1025\nbackend = \"null\"\nsize = \"1MiB\"\n"),
    "subsystem[0].namespace[0].nsid",
    8,
    1,
    "above transport.max_nsid (1024)"
);

// `rbd` namespaces: which image, in which cluster, as whom.
const RBD: &str = "nsid = 1\nbackend = \"rbd\"\n";

error_case!(
    rbd_needs_a_pool,
    namespace(&format!("{RBD}image = \"vol1\"\n")),
    "subsystem[0].namespace[0]",
    7,
    1,
    "backend `rbd` needs `pool`"
);
error_case!(
    rbd_needs_an_image,
    namespace(&format!("{RBD}pool = \"rbd\"\n")),
    "subsystem[0].namespace[0]",
    7,
    1,
    "backend `rbd` needs `image`"
);
error_case!(
    rbd_has_no_path,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\npath = \"/dev/rbd0\"\n"
    )),
    "subsystem[0].namespace[0].path",
    12,
    1,
    "names its image with `pool` and `image`"
);
error_case!(
    rbd_existing_image_has_its_own_size,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\nsize = \"1GiB\"\n"
    )),
    "subsystem[0].namespace[0].size",
    12,
    1,
    "an existing image has its own size"
);
error_case!(
    rbd_create_needs_a_size,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\ncreate = true\n"
    )),
    "subsystem[0].namespace[0]",
    7,
    1,
    "create = true needs the `size`"
);
error_case!(
    rbd_create_size_in_whole_blocks,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\ncreate = true\nsize = 1000\n"
    )),
    "subsystem[0].namespace[0].size",
    13,
    1,
    "not a whole number of 512-byte blocks"
);
error_case!(
    rbd_image_name_without_separators,
    namespace(&format!("{RBD}pool = \"rbd\"\nimage = \"vol1@snap\"\n")),
    "subsystem[0].namespace[0].image",
    11,
    1,
    "separate pool, image and snapshot"
);
error_case!(
    rbd_pool_name_printable,
    namespace(&format!("{RBD}pool = \"my pool\"\nimage = \"vol1\"\n")),
    "subsystem[0].namespace[0].pool",
    10,
    1,
    "holds a space"
);
error_case!(
    rbd_empty_rados_namespace,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\nnamespace = \"\"\n"
    )),
    "subsystem[0].namespace[0].namespace",
    12,
    1,
    "an empty name"
);
error_case!(
    rbd_ceph_conf_absolute,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\nceph_conf = \"ceph.conf\"\n"
    )),
    "subsystem[0].namespace[0].ceph_conf",
    12,
    1,
    "not an absolute path"
);
error_case!(
    rbd_client_id_without_prefix,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\nclient_id = \"client.gw\"\n"
    )),
    "subsystem[0].namespace[0].client_id",
    12,
    1,
    "client_id = \"gw\""
);
error_case!(
    rbd_keys_on_another_backend,
    namespace("nsid = 1\nbackend = \"malloc\"\nsize = \"1MiB\"\npool = \"rbd\"\n"),
    "subsystem[0].namespace[0].pool",
    11,
    1,
    "`pool` is for backend `rbd`, not `malloc`"
);
error_case!(
    rbd_two_namespaces_on_one_image,
    namespace(&format!(
        "{RBD}pool = \"rbd\"\nimage = \"vol1\"\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"vol1\"\n"
    )),
    "subsystem[0].namespace[1].image",
    16,
    1,
    "two namespaces on one image corrupt each other"
);

#[test]
fn rbd_images_of_other_clusters_or_rados_namespaces_are_other_images() {
    for other in [
        "namespace = \"tenant2\"\n",
        "ceph_conf = \"/etc/ceph/other.conf\"\n",
    ] {
        let text = namespace(&format!(
            "{RBD}pool = \"rbd\"\nimage = \"vol1\"\n[[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"vol1\"\n{other}"
        ));
        if let Err(e) = Config::parse(&text, &facts()) {
            panic!("{other}: {e}");
        }
    }
}

/// More namespaces in all than a reactor's engine serves: refused at the first one too many,
/// whichever subsystem it is in.
#[test]
fn more_namespaces_in_all_than_nvmfd_serves() {
    let mut text = LISTENER.to_string();
    for s in 0..2 {
        text.push_str(&format!(
            "[[subsystem]]\nnqn = \"nqn.2024-01.com.example:s{s}\"\nallow_any_host = true\n"
        ));
        for nsid in 1..=513 {
            text.push_str(&format!(
                "[[subsystem.namespace]]\nnsid = {nsid}\nbackend = \"null\"\nsize = \"1MiB\"\n"
            ));
        }
    }
    let e = one_error(&text);
    assert_eq!(e.key, "subsystem[1].namespace[511]", "{e}");
    assert!(e.message.contains("at most 1024 in all"), "{e}");
}
