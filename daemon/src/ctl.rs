//! What `nvmfctl` needs besides the socket: a client, and renderers for tables and Prometheus.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use comfy_table::{presets::UTF8_BORDERS_ONLY, Table};
use serde_json::Value;

use crate::admin::{Request, Response};

/// Why `nvmfctl` failed.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// the socket could not be reached
    #[error("cannot connect to {path}: {source} (is nvmfd running? pass --socket PATH)")]
    Connect {
        /// Socket path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// the exchange failed
    #[error("admin socket: {0}")]
    Io(#[from] std::io::Error),
    /// the daemon's answer was not understood
    #[error("bad answer from nvmfd: {0}")]
    Decode(#[from] serde_json::Error),
    /// the daemon answered with an error
    #[error("nvmfd: {0}")]
    Daemon(String),
}

/// Sends one request and returns the answer's data.
pub fn request(socket: &Path, req: &Request, timeout: Duration) -> Result<Value, CtlError> {
    let mut s = UnixStream::connect(socket).map_err(|source| CtlError::Connect {
        path: socket.display().to_string(),
        source,
    })?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let mut line = serde_json::to_vec(req)?;
    line.push(b'\n');
    s.write_all(&line)?;
    let mut answer = String::new();
    BufReader::new(s).read_line(&mut answer)?;
    if answer.is_empty() {
        return Err(CtlError::Io(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the daemon closed the connection without answering",
        )));
    }
    let resp: Response = serde_json::from_str(&answer)?;
    match (resp.ok, resp.data, resp.error) {
        (true, Some(d), _) => Ok(d),
        (_, _, Some(e)) => Err(CtlError::Daemon(e)),
        _ => Err(CtlError::Daemon(
            "an answer with neither data nor error".into(),
        )),
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) if a.iter().all(|x| !x.is_object() && !x.is_array()) => {
            a.iter().map(scalar).collect::<Vec<_>>().join(", ")
        }
        other => other.to_string(),
    }
}

fn heading(key: &str) -> String {
    key.trim_end_matches("_total").replace('_', " ")
}

/// Renders a JSON tree as readable tables: scalars as `key: value` lines, objects as two-column
/// tables, arrays of objects as one table with a column per key.
pub fn render_tables(v: &Value) -> String {
    let mut out = String::new();
    render_into(&mut out, None, v);
    out
}

fn render_into(out: &mut String, title: Option<&str>, v: &Value) {
    match v {
        Value::Object(map) => {
            let mut kv = Table::new();
            kv.load_style(UTF8_BORDERS_ONLY);
            let mut any_kv = false;
            let mut nested = Vec::new();
            for (k, x) in map {
                let is_table = matches!(x, Value::Object(_))
                    || matches!(x, Value::Array(a) if a.is_empty() || a.iter().any(|e| e.is_object()));
                if is_table {
                    nested.push((k, x));
                } else {
                    kv.add_row(vec![heading(k), scalar(x)]);
                    any_kv = true;
                }
            }
            if any_kv {
                if let Some(t) = title {
                    out.push_str(&format!("{t}\n"));
                }
                out.push_str(&format!("{kv}\n"));
            }
            for (k, x) in nested {
                let t = match title {
                    Some(t) => format!("{t} / {}", heading(k)),
                    None => heading(k),
                };
                render_into(out, Some(&t), x);
            }
        }
        Value::Array(items) => {
            if let Some(t) = title {
                out.push_str(&format!("{t}\n"));
            }
            if items.is_empty() {
                out.push_str("  (none)\n");
                return;
            }
            let mut cols: Vec<String> = Vec::new();
            for it in items {
                if let Value::Object(m) = it {
                    for k in m.keys() {
                        if !cols.contains(k) {
                            cols.push(k.clone());
                        }
                    }
                }
            }
            let mut t = Table::new();
            t.load_style(UTF8_BORDERS_ONLY);
            t.set_header(cols.iter().map(|c| heading(c)));
            for it in items {
                t.add_row(
                    cols.iter()
                        .map(|c| scalar(it.get(c).unwrap_or(&Value::Null))),
                );
            }
            out.push_str(&format!("{t}\n"));
        }
        other => out.push_str(&format!(
            "{}{}\n",
            title.map(|t| format!("{t}: ")).unwrap_or_default(),
            scalar(other)
        )),
    }
}

/// Keys whose values label a series rather than being one.
const LABEL_KEYS: [&str; 2] = ["id", "core"];

/// Renders a stats tree as Prometheus text exposition (version 0.0.4).
///
/// Numbers and booleans become samples named `nvmfd_<path>`; in arrays of objects the strings
/// and the keys `id` and `core` become labels. Names ending in `_total` are counters, the rest
/// gauges.
pub fn render_prometheus(stats: &Value) -> String {
    let mut samples: Vec<(String, String, String)> = Vec::new();
    collect(&mut samples, "nvmfd", &[], stats);
    let mut typed: Vec<String> = Vec::new();
    for (name, _, _) in &samples {
        if !typed.contains(name) {
            typed.push(name.clone());
        }
    }
    // Group each metric's samples under its TYPE line, as the format requires.
    let mut grouped = String::new();
    for name in &typed {
        grouped.push_str(&format!(
            "# TYPE {name} {}\n",
            if name.ends_with("_total") {
                "counter"
            } else {
                "gauge"
            }
        ));
        for (n, labels, value) in &samples {
            if n == name {
                grouped.push_str(&format!("{n}{labels} {value}\n"));
            }
        }
    }
    grouped
}

fn metric_name(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn collect(
    out: &mut Vec<(String, String, String)>,
    prefix: &str,
    labels: &[(String, String)],
    v: &Value,
) {
    let label_text = |labels: &[(String, String)]| {
        if labels.is_empty() {
            String::new()
        } else {
            let inner: Vec<String> = labels
                .iter()
                .map(|(k, v)| format!("{}=\"{}\"", metric_name(k), escape_label(v)))
                .collect();
            format!("{{{}}}", inner.join(","))
        }
    };
    match v {
        Value::Number(n) => out.push((prefix.to_owned(), label_text(labels), n.to_string())),
        Value::Bool(b) => out.push((
            prefix.to_owned(),
            label_text(labels),
            u8::from(*b).to_string(),
        )),
        Value::Object(m) => {
            for (k, x) in m {
                collect(out, &format!("{prefix}_{}", metric_name(k)), labels, x);
            }
        }
        Value::Array(items) => {
            // `reactors` -> series `nvmfd_reactor_*` labelled by each item's identity.
            let base = prefix.strip_suffix('s').unwrap_or(prefix).to_owned();
            for it in items {
                let Value::Object(m) = it else { continue };
                let mut l = labels.to_vec();
                for (k, x) in m {
                    if LABEL_KEYS.contains(&k.as_str()) || x.is_string() {
                        l.push((k.clone(), scalar(x)));
                    }
                }
                for (k, x) in m {
                    if !(LABEL_KEYS.contains(&k.as_str()) || x.is_string()) {
                        collect(out, &format!("{base}_{}", metric_name(k)), &l, x);
                    }
                }
            }
        }
        Value::String(_) | Value::Null => {}
    }
}

/// Removes nulls (TOML has none) so that a JSON tree can be printed as TOML.
pub fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, x| !x.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prometheus_groups_series_with_labels_and_types() {
        let stats = json!({
            "uptime_seconds": 5,
            "reactors": [
                {"id": 0, "core": 2, "turns_total": 10, "stalled": false},
                {"id": 1, "core": 3, "turns_total": 20, "stalled": true}
            ],
            "admin": {"clients": 1, "requests_total": 7}
        });
        let text = render_prometheus(&stats);
        let expected = "\
# TYPE nvmfd_uptime_seconds gauge
nvmfd_uptime_seconds 5
# TYPE nvmfd_reactor_turns_total counter
nvmfd_reactor_turns_total{id=\"0\",core=\"2\"} 10
nvmfd_reactor_turns_total{id=\"1\",core=\"3\"} 20
# TYPE nvmfd_reactor_stalled gauge
nvmfd_reactor_stalled{id=\"0\",core=\"2\"} 0
nvmfd_reactor_stalled{id=\"1\",core=\"3\"} 1
# TYPE nvmfd_admin_clients gauge
nvmfd_admin_clients 1
# TYPE nvmfd_admin_requests_total counter
nvmfd_admin_requests_total 7
";
        assert_eq!(text, expected);
    }

    #[test]
    fn label_values_are_escaped() {
        let text = render_prometheus(&json!({"qps": [{"host": "a\"b\\c", "n": 1}]}));
        assert_eq!(
            text,
            "# TYPE nvmfd_qp_n gauge\nnvmfd_qp_n{host=\"a\\\"b\\\\c\"} 1\n"
        );
    }

    #[test]
    fn tables_show_scalars_objects_and_arrays() {
        let t = render_tables(&json!({
            "version": "0.1.0",
            "reactors": [{"id": 0, "core": 1}],
            "listeners": []
        }));
        assert!(t.contains("version"), "{t}");
        assert!(t.contains("0.1.0"), "{t}");
        assert!(t.contains("reactors\n"), "{t}");
        assert!(t.contains("listeners\n  (none)"), "{t}");
    }
}
