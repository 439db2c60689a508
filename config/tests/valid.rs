//! Valid configurations: defaults, the shipped examples, and round trips.

use std::path::Path;

use nvmfd_config::{Backend, ByteSize, Config, LogLevel, Provider, SystemFacts};

fn facts() -> SystemFacts {
    SystemFacts {
        allowed_cores: vec![0, 1],
    }
}

#[test]
fn defaults_fill_every_missing_key() {
    let cfg = Config::parse(
        "[[listener]]\naddress = \"::1\"\n[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\nhosts = [\"nqn.2014-08.org.nvmexpress:uuid:6c61622d-0000-4000-8000-000000000001\"]\n",
        &facts(),
    )
    .unwrap();
    assert_eq!(cfg.daemon.reactor_cores, [0]);
    assert_eq!(cfg.daemon.admin_socket, Path::new("/run/nvmfd/nvmfd.sock"));
    assert_eq!(cfg.daemon.log_level, LogLevel::Info);
    assert_eq!(cfg.listeners[0].port, 4420);
    assert_eq!(cfg.listeners[0].provider, Provider::Ibverbs);
    assert_eq!(cfg.transport.in_capsule_data_size, ByteSize::kib(4));
    assert_eq!(cfg.transport.max_io_size, ByteSize::kib(128));
    assert_eq!(cfg.subsystems[0].model, "nvmfd");
    let serial = cfg.subsystems[0].serial_number();
    assert_eq!(serial.len(), 20);
    assert!(serial.chars().all(|c| c.is_ascii_hexdigit()));
}

#[test]
fn every_shipped_example_is_valid() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut examples: Vec<_> = std::fs::read_dir(root.join("config/examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    examples.push(root.join("systemd/nvmfd.toml"));
    let mut n = 0;
    for path in examples
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
    {
        // The examples may pin reactors to any core; validate them against a 2-core machine.
        Config::load(path, &facts()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        n += 1;
    }
    assert!(
        n >= 2,
        "expected the examples and the systemd config, found {n}"
    );
}

#[test]
fn a_full_config_round_trips_through_json_and_toml() {
    let text = r#"
        [daemon]
        reactor_cores = [0, 1]
        admin_socket = "/tmp/nvmfd.sock"
        log_level = "debug"
        log_format = "json"
        [[listener]]
        address = "192.0.2.1"
        port = 4421
        provider = "ibverbs"
        [transport]
        in_capsule_data_size = "16KiB"
        max_io_size = "1MiB"
        keep_alive_timeout_max = "2min"
        [[subsystem]]
        nqn = "nqn.2024-01.com.example:disks"
        serial = "SN0001"
        allow_any_host = true
        [[subsystem.namespace]]
        nsid = 1
        backend = "file"
        path = "/var/lib/nvmfd/disk0.img"
        block_size = 4096
        uuid = "6c61622d-0000-4000-8000-000000000002"
        nguid = "0123456789abcdef0123456789abcdef"
        [[subsystem.namespace]]
        nsid = 7
        backend = "malloc"
        size = "64MiB"
        read_only = true
    "#;
    let cfg = Config::parse(text, &facts()).unwrap();
    assert_eq!(cfg.subsystems[0].namespaces[1].backend, Backend::Malloc);
    assert_eq!(
        cfg.subsystems[0].namespaces[1].size,
        Some(ByteSize::mib(64))
    );
    assert_eq!(cfg.transport.keep_alive_timeout_max.0.as_secs(), 120);
    let json = serde_json::to_value(&cfg).unwrap();
    assert_eq!(json["transport"]["max_io_size"], "1MiB");
    assert_eq!(json["transport"]["keep_alive_timeout_max"], "2m");
    let again: Config = serde_json::from_value(json).unwrap();
    assert_eq!(again, cfg);
}

/// An `rbd` namespace: the defaults of its optional keys.
#[test]
fn an_rbd_namespace_takes_the_usual_ceph_defaults() {
    let cfg = Config::parse(
        "[[listener]]\naddress = \"::1\"\n[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\nallow_any_host = true\n\
         [[subsystem.namespace]]\nnsid = 1\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"vol1\"\n",
        &facts(),
    )
    .unwrap();
    let ns = &cfg.subsystems[0].namespaces[0];
    assert_eq!(ns.backend, Backend::Rbd);
    assert_eq!(ns.ceph_conf(), Path::new("/etc/ceph/ceph.conf"));
    assert_eq!(ns.client_id(), "admin");
    assert_eq!(
        (ns.namespace.as_deref(), ns.create, ns.size),
        (None, false, None)
    );
}

/// Every key of the schema appears in docs/CONFIGURATION.md, so the reference cannot fall behind.
#[test]
fn every_key_is_documented() {
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/CONFIGURATION.md"),
    )
    .unwrap();
    let cfg = Config::parse(
        "[[listener]]\naddress = \"::1\"\n[[subsystem]]\nnqn = \"nqn.2024-01.com.example:a\"\nserial = \"s\"\nallow_any_host = true\n\
         [[subsystem.namespace]]\nnsid = 1\nbackend = \"null\"\nsize = 4096\nuuid = \"6c61622d-0000-4000-8000-000000000001\"\nnguid = \"0123456789abcdef0123456789abcdef\"\n\
         [[subsystem.namespace]]\nnsid = 2\nbackend = \"rbd\"\npool = \"rbd\"\nimage = \"i\"\nnamespace = \"n\"\nceph_conf = \"/c\"\nclient_id = \"u\"\ncreate = true\nsize = 4096\n",
        &facts(),
    )
    .unwrap();
    let json = serde_json::to_value(&cfg).unwrap();
    let mut keys = Vec::new();
    fn walk(v: &serde_json::Value, keys: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    keys.push(k.clone());
                    walk(x, keys);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, keys)),
            _ => {}
        }
    }
    walk(&json, &mut keys);
    assert!(keys.len() > 30, "walked only {keys:?}");
    for k in keys {
        let documented = match k.as_str() {
            "daemon" | "transport" => doc.contains(&format!("`[{k}]`")),
            "listener" | "subsystem" => doc.contains(&format!("`[[{k}]]`")),
            "namespace" => doc.contains("`[[subsystem.namespace]]`"),
            key => doc.contains(&format!("| `{key}` |")),
        };
        assert!(documented, "`{k}` is missing from docs/CONFIGURATION.md");
    }
}
