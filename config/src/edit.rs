//! Changes to a configuration made while the daemon runs, applied to the text of its file
//! with `toml_edit`, so that comments, order and layout of everything else stay as they were.
//! The edited text is then validated as any configuration file is ([`Config::parse`]): a change
//! is refused with the same messages a file with the same content would get.

use std::net::IpAddr;

use toml_edit::{ArrayOfTables, DocumentMut, Item, Table};

use crate::{ByteSize, Listener, Namespace, Subsystem};

/// One change of the configuration.
#[derive(Clone, Debug, PartialEq)]
pub enum Edit {
    /// Adds a `[[subsystem]]` (with its namespaces).
    AddSubsystem(Subsystem),
    /// Removes the subsystem with this NQN.
    RemoveSubsystem(String),
    /// Adds a namespace to a subsystem.
    AddNamespace(String, Namespace),
    /// Removes namespace NSID of a subsystem.
    RemoveNamespace(String, u32),
    /// Sets a namespace's `size` (backends that have one in the configuration).
    SetNamespaceSize(String, u32, ByteSize),
    /// Allows a host NQN to connect to a subsystem.
    AddHost(String, String),
    /// Removes a host NQN from a subsystem's `hosts`.
    RemoveHost(String, String),
    /// Sets a subsystem's `allow_any_host`.
    AllowAnyHost(String, bool),
    /// Adds a `[[listener]]`.
    AddListener(Listener),
    /// Removes the listener at this address and port (of this provider: needed only when
    /// two listeners, one per provider, share the address and port).
    RemoveListener(IpAddr, u16, Option<crate::Provider>),
}

/// Serialises `v` as a TOML table.
fn table_of<T: serde::Serialize>(v: &T) -> Result<Table, String> {
    let text = toml::to_string(v).map_err(|e| e.to_string())?;
    let doc: DocumentMut = text
        .parse()
        .map_err(|e: toml_edit::TomlError| e.to_string())?;
    Ok(doc.as_table().clone())
}

fn array<'a>(doc: &'a mut Table, key: &str) -> Result<&'a mut ArrayOfTables, String> {
    let item = doc
        .entry(key)
        .or_insert_with(|| Item::ArrayOfTables(ArrayOfTables::new()));
    item.as_array_of_tables_mut()
        .ok_or_else(|| format!("`{key}` is not an array of tables"))
}

fn str_of(t: &Table, key: &str) -> Option<String> {
    t.get(key)?.as_str().map(str::to_owned)
}

fn subsystem<'a>(doc: &'a mut DocumentMut, nqn: &str) -> Result<&'a mut Table, String> {
    array(doc.as_table_mut(), "subsystem")?
        .iter_mut()
        .find(|t| str_of(t, "nqn").as_deref() == Some(nqn))
        .ok_or_else(|| format!("no subsystem {nqn}"))
}

fn namespace<'a>(doc: &'a mut DocumentMut, nqn: &str, nsid: u32) -> Result<&'a mut Table, String> {
    array(subsystem(doc, nqn)?, "namespace")?
        .iter_mut()
        .find(|t| t.get("nsid").and_then(Item::as_integer) == Some(i64::from(nsid)))
        .ok_or_else(|| format!("subsystem {nqn} has no namespace {nsid}"))
}

fn hosts(t: &mut Table) -> Result<&mut toml_edit::Array, String> {
    t.entry("hosts")
        .or_insert_with(|| toml_edit::value(toml_edit::Array::new()))
        .as_array_mut()
        .ok_or_else(|| "`hosts` is not an array".to_owned())
}

impl Edit {
    /// Applies the change to `doc`. An edit that names what is not there (a subsystem,
    /// namespace, host or listener) is an error saying so; what the result must satisfy is
    /// left to validation.
    pub fn apply(&self, doc: &mut DocumentMut) -> Result<(), String> {
        match self {
            Edit::AddSubsystem(s) => {
                // Its namespaces as `[[subsystem.namespace]]` tables, as a file has them.
                let mut t = table_of(&Subsystem {
                    namespaces: Vec::new(),
                    ..s.clone()
                })?;
                t.remove("namespace");
                let mut nss = ArrayOfTables::new();
                for ns in &s.namespaces {
                    nss.push(table_of(ns)?);
                }
                if !nss.is_empty() {
                    t.insert("namespace", Item::ArrayOfTables(nss));
                }
                array(doc.as_table_mut(), "subsystem")?.push(t);
            }
            Edit::RemoveSubsystem(nqn) => {
                let a = array(doc.as_table_mut(), "subsystem")?;
                let i = a
                    .iter()
                    .position(|t| str_of(t, "nqn").as_deref() == Some(nqn))
                    .ok_or_else(|| format!("no subsystem {nqn}"))?;
                a.remove(i);
            }
            Edit::AddNamespace(nqn, ns) => {
                array(subsystem(doc, nqn)?, "namespace")?.push(table_of(ns)?);
            }
            Edit::RemoveNamespace(nqn, nsid) => {
                let a = array(subsystem(doc, nqn)?, "namespace")?;
                let i = a
                    .iter()
                    .position(|t| {
                        t.get("nsid").and_then(Item::as_integer) == Some(i64::from(*nsid))
                    })
                    .ok_or_else(|| format!("subsystem {nqn} has no namespace {nsid}"))?;
                a.remove(i);
            }
            Edit::SetNamespaceSize(nqn, nsid, size) => {
                // Only where the configuration holds the size: RAM and null, and an RBD
                // image nvmfd creates. A file, device or existing image has its own.
                let t = namespace(doc, nqn, *nsid)?;
                let backend = str_of(t, "backend").unwrap_or_default();
                let creates = t.get("create").and_then(Item::as_bool) == Some(true);
                if matches!(backend.as_str(), "malloc" | "null") || (backend == "rbd" && creates) {
                    t["size"] = toml_edit::value(size.to_string());
                }
            }
            Edit::AddHost(nqn, host) => {
                // A listed host makes the subsystem admit only its listed hosts (the file
                // cannot have both).
                let t = subsystem(doc, nqn)?;
                if t.get("allow_any_host").and_then(Item::as_bool) == Some(true) {
                    t["allow_any_host"] = toml_edit::value(false);
                }
                let h = hosts(t)?;
                if h.iter().any(|v| v.as_str() == Some(host)) {
                    return Err(format!("host {host} is already allowed on {nqn}"));
                }
                h.push(host.as_str());
            }
            Edit::RemoveHost(nqn, host) => {
                let h = hosts(subsystem(doc, nqn)?)?;
                let i = h
                    .iter()
                    .position(|v| v.as_str() == Some(host))
                    .ok_or_else(|| format!("host {host} is not in the hosts of {nqn}"))?;
                h.remove(i);
            }
            Edit::AllowAnyHost(nqn, allow) => {
                let t = subsystem(doc, nqn)?;
                t["allow_any_host"] = toml_edit::value(*allow);
                // Every host admitted: the list has no meaning left.
                if *allow {
                    t.remove("hosts");
                }
            }
            Edit::AddListener(l) => {
                array(doc.as_table_mut(), "listener")?.push(table_of(l)?);
            }
            Edit::RemoveListener(addr, port, provider) => {
                let a = array(doc.as_table_mut(), "listener")?;
                let provider_of = |t: &Table| match str_of(t, "provider").as_deref() {
                    Some("soft") => Some(crate::Provider::Soft),
                    Some("ibverbs") | None => Some(crate::Provider::Ibverbs),
                    Some(_) => None,
                };
                let matching: Vec<usize> = a
                    .iter()
                    .enumerate()
                    .filter(|(_, t)| {
                        let p = t.get("port").and_then(Item::as_integer).unwrap_or(4420);
                        str_of(t, "address").and_then(|s| s.parse::<IpAddr>().ok()) == Some(*addr)
                            && p == i64::from(*port)
                            && provider.is_none_or(|want| provider_of(t) == Some(want))
                    })
                    .map(|(i, _)| i)
                    .collect();
                let at = sockaddr(*addr, *port);
                match matching[..] {
                    [i] => drop(a.remove(i)),
                    [] => {
                        return Err(match provider {
                            Some(p) => format!("no {p} listener {at}"),
                            None => format!("no listener {at}"),
                        })
                    }
                    _ => {
                        return Err(format!(
                            "two listeners on {at}, one per provider: say which (provider soft or ibverbs)"
                        ))
                    }
                }
            }
        }
        Ok(())
    }
}

/// `addr:port`, with brackets around an IPv6 address.
pub fn sockaddr(addr: IpAddr, port: u16) -> String {
    std::net::SocketAddr::new(addr, port).to_string()
}

/// Parses configuration text for editing.
pub fn document(text: &str) -> Result<DocumentMut, String> {
    text.parse()
        .map_err(|e: toml_edit::TomlError| format!("TOML syntax: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two listeners on one address and port, one per provider (the configuration allows
    /// it): removing one without saying which is refused, not the first in the file taken.
    #[test]
    fn removing_one_of_two_listeners_on_one_address_needs_its_provider() {
        let text = "[[listener]]\naddress = \"10.0.0.1\"\nport = 4420\nprovider = \"soft\"\n\n\
                    [[listener]]\naddress = \"10.0.0.1\"\nport = 4420\n";
        let addr: IpAddr = "10.0.0.1".parse().unwrap();
        let mut doc = document(text).unwrap();
        let e = Edit::RemoveListener(addr, 4420, None)
            .apply(&mut doc)
            .unwrap_err();
        assert!(e.contains("say which"), "{e}");
        Edit::RemoveListener(addr, 4420, Some(crate::Provider::Ibverbs))
            .apply(&mut doc)
            .unwrap();
        let left = doc.to_string();
        assert!(left.contains("provider = \"soft\""), "{left}");
        assert_eq!(left.matches("[[listener]]").count(), 1, "{left}");
        let e = Edit::RemoveListener(addr, 4420, Some(crate::Provider::Ibverbs))
            .apply(&mut doc)
            .unwrap_err();
        assert!(e.contains("no ibverbs listener 10.0.0.1:4420"), "{e}");
        // One left: no provider needed.
        Edit::RemoveListener(addr, 4420, None)
            .apply(&mut doc)
            .unwrap();
    }
}
