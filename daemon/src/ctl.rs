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

/// Keys whose values label a series rather than being one (`reactor`: the data path
/// entries' reactor index).
const LABEL_KEYS: [&str; 3] = ["id", "core", "reactor"];

/// Renders a stats tree in the Prometheus text format (0.0.4: what node_exporter's textfile
/// collector and every Prometheus parser read), from prometheus-client's OpenMetrics encoding.
///
/// Numbers and booleans become samples named `nvmfd_<path>`; in arrays of objects the strings
/// and the keys `id`, `core` and `reactor` become labels. Names ending in `_total` are counters
/// (HELP and TYPE name the samples, suffix included), the rest gauges. A family's help is the
/// path of its values in the stats tree.
pub fn render_prometheus(stats: &Value) -> String {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;
    type Labels = Vec<(String, String)>;

    let mut samples: Vec<Sample> = Vec::new();
    collect(&mut samples, "", "", &[], stats);
    let mut names: Vec<&str> = Vec::new();
    for s in &samples {
        if !names.contains(&s.name.as_str()) {
            names.push(&s.name);
        }
    }
    let mut registry = Registry::with_prefix("nvmfd");
    for name in names {
        let of = || samples.iter().filter(move |s| s.name == name);
        let help = of().next().map_or(String::new(), |s| s.path.clone());
        let whole = of().all(|s| s.int.is_some());
        if let [single] = of().collect::<Vec<_>>()[..] {
            if single.labels.is_empty() {
                // One series without labels: a plain metric, not a family.
                register_single(&mut registry, name, help, single);
                continue;
            }
        }
        match (name.strip_suffix("_total"), whole) {
            (Some(base), true) => {
                let f = Family::<Labels, Counter>::default();
                of().for_each(|s| {
                    f.get_or_create(&s.labels).inc_by(s.int.unwrap_or(0));
                });
                registry.register(base, help, f);
            }
            (Some(base), false) => {
                let f = Family::<Labels, Counter<f64, std::sync::atomic::AtomicU64>>::default();
                of().for_each(|s| {
                    f.get_or_create(&s.labels).inc_by(s.value);
                });
                registry.register(base, help, f);
            }
            (None, true) => {
                let f = Family::<Labels, Gauge>::default();
                of().for_each(|s| {
                    f.get_or_create(&s.labels)
                        .set(i64::try_from(s.int.unwrap_or(0)).unwrap_or(i64::MAX));
                });
                registry.register(name, help, f);
            }
            (None, false) => {
                let f = Family::<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
                of().for_each(|s| {
                    f.get_or_create(&s.labels).set(s.value);
                });
                registry.register(name, help, f);
            }
        }
    }
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = encode(&mut out, &registry);
    prometheus_text(&out)
}

/// OpenMetrics text as the Prometheus text format: a counter family's HELP and TYPE lines name
/// its samples (`x_total`; OpenMetrics names the family `x`, which a Prometheus text parser
/// takes for another metric, leaving the samples untyped), and no `# UNIT` or `# EOF` lines.
fn prometheus_text(open_metrics: &str) -> String {
    let mut out = String::with_capacity(open_metrics.len() + 256);
    let mut help: Option<&str> = None;
    let push = |out: &mut String, line: &str| {
        out.push_str(line);
        out.push('\n');
    };
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if line.starts_with("# HELP ") {
            if let Some(h) = help.replace(line) {
                push(&mut out, h);
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if kind == "counter" && !name.ends_with("_total") {
                if let Some(h) = help.take() {
                    let text = h
                        .strip_prefix("# HELP ")
                        .and_then(|t| t.strip_prefix(name))
                        .unwrap_or("");
                    push(&mut out, &format!("# HELP {name}_total{text}"));
                }
                push(&mut out, &format!("# TYPE {name}_total counter"));
                continue;
            }
        }
        if let Some(h) = help.take() {
            push(&mut out, h);
        }
        push(&mut out, line);
    }
    if let Some(h) = help {
        push(&mut out, h);
    }
    out
}

/// Registers `name`'s one series, without labels.
fn register_single(
    registry: &mut prometheus_client::registry::Registry,
    name: &str,
    help: String,
    s: &Sample,
) {
    let value = s.value;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::gauge::Gauge;
    use std::sync::atomic::AtomicU64;
    match (name.strip_suffix("_total"), s.int) {
        (Some(base), Some(n)) => {
            let c = Counter::<u64>::default();
            c.inc_by(n);
            registry.register(base, help, c);
        }
        (Some(base), None) => {
            let c = Counter::<f64, AtomicU64>::default();
            c.inc_by(value);
            registry.register(base, help, c);
        }
        (None, Some(n)) => {
            let g = Gauge::<i64>::default();
            g.set(i64::try_from(n).unwrap_or(i64::MAX));
            registry.register(name, help, g);
        }
        (None, None) => {
            let g = Gauge::<f64, AtomicU64>::default();
            g.set(value);
            registry.register(name, help, g);
        }
    }
}

/// One sample of the stats tree: its metric name (without the `nvmfd_` prefix), the path of
/// its values in the tree, its labels and value.
struct Sample {
    name: String,
    path: String,
    labels: Vec<(String, String)>,
    value: f64,
    /// The value, when it is a whole number that is not negative.
    int: Option<u64>,
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
    out: &mut Vec<Sample>,
    prefix: &str,
    path: &str,
    labels: &[(String, String)],
    v: &Value,
) {
    let join = |a: &str, b: &str| {
        if a.is_empty() {
            b.to_owned()
        } else {
            format!("{a}_{b}")
        }
    };
    let sample = |value: f64, int: Option<u64>| Sample {
        name: prefix.to_owned(),
        path: path.to_owned(),
        labels: labels
            .iter()
            .map(|(k, v)| (metric_name(k), escape_label(v)))
            .collect(),
        value,
        int,
    };
    match v {
        Value::Number(n) => out.push(sample(n.as_f64().unwrap_or(0.0), n.as_u64())),
        Value::Bool(b) => out.push(sample(f64::from(u8::from(*b)), Some(u64::from(*b)))),
        Value::Object(m) => {
            for (k, x) in m {
                let p = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                collect(out, &join(prefix, &metric_name(k)), &p, labels, x);
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
                        let p = format!("{path}[].{k}");
                        collect(out, &join(&base, &metric_name(k)), &p, &l, x);
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

/// Renders `controllers`: one row per controller, its queues as `qid:depth` pairs.
pub fn render_controllers(v: &Value) -> String {
    let Some(items) = v.as_array() else {
        return render_tables(v);
    };
    if items.is_empty() {
        return "no controller\n".into();
    }
    let mut t = Table::new();
    t.load_style(UTF8_BORDERS_ONLY);
    t.set_header(vec![
        "cntlid",
        "subsystem",
        "host",
        "address",
        "queues (qid:depth)",
        "keep-alive",
        "commands",
    ]);
    for c in items {
        let queues = c["queues"]
            .as_array()
            .map(|q| {
                q.iter()
                    .map(|q| format!("{}:{}", q["qid"], q["depth"]))
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .unwrap_or_default();
        t.add_row(vec![
            scalar(&c["cntlid"]),
            scalar(&c["subsystem"]),
            scalar(&c["host"]),
            scalar(&c["host_address"]),
            queues,
            format!("{} ms", c["keep_alive_ms"]),
            scalar(&c["commands"]),
        ]);
    }
    format!("{t}\n")
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
            "datapath": [
                {"reactor": 0, "qps": 3, "commands_total": 100},
                {"reactor": 1, "qps": 5, "commands_total": 200}
            ],
            "admin": {"clients": 1, "requests_total": 7},
            "busy_ratio": 0.25
        });
        let text = render_prometheus(&stats);
        let expected = "\
# HELP nvmfd_uptime_seconds uptime_seconds.
# TYPE nvmfd_uptime_seconds gauge
nvmfd_uptime_seconds 5
# HELP nvmfd_reactor_turns_total reactors[].turns_total.
# TYPE nvmfd_reactor_turns_total counter
nvmfd_reactor_turns_total{id=\"0\",core=\"2\"} 10
nvmfd_reactor_turns_total{id=\"1\",core=\"3\"} 20
# HELP nvmfd_reactor_stalled reactors[].stalled.
# TYPE nvmfd_reactor_stalled gauge
nvmfd_reactor_stalled{id=\"0\",core=\"2\"} 0
nvmfd_reactor_stalled{id=\"1\",core=\"3\"} 1
# HELP nvmfd_datapath_qps datapath[].qps.
# TYPE nvmfd_datapath_qps gauge
nvmfd_datapath_qps{reactor=\"0\"} 3
nvmfd_datapath_qps{reactor=\"1\"} 5
# HELP nvmfd_datapath_commands_total datapath[].commands_total.
# TYPE nvmfd_datapath_commands_total counter
nvmfd_datapath_commands_total{reactor=\"0\"} 100
nvmfd_datapath_commands_total{reactor=\"1\"} 200
# HELP nvmfd_admin_clients admin.clients.
# TYPE nvmfd_admin_clients gauge
nvmfd_admin_clients 1
# HELP nvmfd_admin_requests_total admin.requests_total.
# TYPE nvmfd_admin_requests_total counter
nvmfd_admin_requests_total 7
# HELP nvmfd_busy_ratio busy_ratio.
# TYPE nvmfd_busy_ratio gauge
nvmfd_busy_ratio 0.25
";
        // Within a family the series come in no particular order.
        fn sorted(t: &str) -> Vec<&str> {
            let mut l: Vec<&str> = t.lines().collect();
            l.sort_unstable();
            l
        }
        assert_eq!(sorted(&text), sorted(expected), "{text}");
        let meta = |t: &str| {
            t.lines()
                .filter(|l| l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        };
        assert_eq!(meta(&text), meta(expected), "families in the tree's order");
        // Every sample follows its family's HELP and TYPE lines, which name it exactly (a
        // Prometheus text parser takes a sample of another name for an untyped metric).
        let mut family = "";
        let mut helped = "";
        for l in text.lines() {
            if let Some(h) = l.strip_prefix("# HELP ") {
                helped = h.split(' ').next().unwrap_or("");
            } else if let Some(t) = l.strip_prefix("# TYPE ") {
                family = t.split(' ').next().unwrap_or("");
                assert_eq!(family, helped, "TYPE without its HELP");
            } else {
                let name = l.split(['{', ' ']).next().unwrap_or("");
                assert_eq!(name, family, "{l} outside its family {family}");
            }
        }
    }

    #[test]
    fn label_values_are_escaped() {
        let text = render_prometheus(&json!({"qps": [{"host": "a\"b\\c", "n": 1}]}));
        assert!(
            text.contains("nvmfd_qp_n{host=\"a\\\"b\\\\c\"} 1\n"),
            "{text}"
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
