//! What is accepted with a warning: NQNs outside the specification's form, as the Linux
//! kernel's host and target accept them. Their length and characters are still errors
//! (tests/errors.rs).

use nvmfd_config::{Config, SystemFacts};

fn facts() -> SystemFacts {
    SystemFacts {
        allowed_cores: vec![0, 1, 2, 3],
    }
}

fn config(nqn: &str, host: &str) -> String {
    format!(
        "[[listener]]\naddress = \"127.0.0.1\"\nprovider = \"soft\"\n\n[[subsystem]]\nnqn = \"{nqn}\"\nhosts = [\"{host}\"]\n"
    )
}

const GOOD_HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:6e766d66-0000-4000-8000-000000000001";

#[test]
fn a_subsystem_nqn_outside_the_form_is_accepted_with_a_warning_naming_the_key_and_the_reason() {
    for (nqn, why) in [
        ("blktests-subsystem-1", "does not start with `nqn.`"),
        ("iqn.2024-01.com.example:a", "does not start with `nqn.`"),
        ("nqn.2024-13.com.example:a", "no valid yyyy-mm date"),
        ("nqn.2024-01.com..example:a", "reverse domain name"),
        ("nqn.2024-01.com.example:", "no name after it"),
        (
            "nqn.2014-08.org.nvmexpress:uuid:not-a-uuid",
            "is not a UUID",
        ),
        // The UUID parser's other forms: the specification's is the hyphenated one.
        (
            "nqn.2014-08.org.nvmexpress:uuid:6e766d6600004000800000000000000a",
            "hyphenated form",
        ),
        (
            "nqn.2014-08.org.nvmexpress:uuid:{6e766d66-0000-4000-8000-00000000000a}",
            "hyphenated form",
        ),
        (
            "nqn.2014-08.org.nvmexpress:uuid:urn:uuid:6e766d66-0000-4000-8000-00000000000a",
            "hyphenated form",
        ),
    ] {
        let cfg = Config::parse(&config(nqn, GOOD_HOST), &facts())
            .unwrap_or_else(|e| panic!("`{nqn}` refused: {e}"));
        let w = cfg.warnings();
        assert_eq!(w.len(), 1, "{nqn}: {w:?}");
        assert!(w[0].starts_with("subsystem[0].nqn: "), "{w:?}");
        assert!(w[0].contains(why) && w[0].contains("accepted"), "{w:?}");
    }
}

#[test]
fn a_host_nqn_outside_the_form_is_accepted_with_a_warning() {
    let cfg = Config::parse(&config("nqn.2024-01.com.example:a", "host-one"), &facts()).unwrap();
    let w = cfg.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].starts_with("subsystem[0].hosts[0]: "), "{w:?}");
}

#[test]
fn nqns_in_the_form_give_no_warning() {
    let cfg = Config::parse(&config("nqn.2024-01.com.example:a", GOOD_HOST), &facts()).unwrap();
    assert!(cfg.warnings().is_empty(), "{:?}", cfg.warnings());
    // Hex digits of either case.
    let upper = "nqn.2014-08.org.nvmexpress:uuid:6E766D66-0000-4000-8000-00000000000A";
    let cfg = Config::parse(&config(upper, GOOD_HOST), &facts()).unwrap();
    assert!(cfg.warnings().is_empty(), "{:?}", cfg.warnings());
}

/// A keep-alive maximum below the Linux host's default (5 s) refuses its connections unless
/// it asks for less: accepted, with a warning naming the key.
#[test]
fn a_keep_alive_maximum_below_the_linux_hosts_default_is_warned_about() {
    let text = format!(
        "{}[transport]\nkeep_alive_timeout_max = \"2s\"\nkeep_alive_timeout_min = \"1s\"\n",
        config("nqn.2024-01.com.example:a", GOOD_HOST)
    );
    let cfg = Config::parse(&text, &facts()).unwrap_or_else(|e| panic!("refused: {e}"));
    let w = cfg.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].starts_with("transport.keep_alive_timeout_max: "),
        "{w:?}"
    );
    assert!(w[0].contains("Linux host's default"), "{w:?}");
    let text = config("nqn.2024-01.com.example:a", GOOD_HOST);
    assert!(Config::parse(&text, &facts())
        .unwrap()
        .warnings()
        .is_empty());
}
