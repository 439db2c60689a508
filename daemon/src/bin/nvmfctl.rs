//! `nvmfctl`: ask a running nvmfd how it is doing, through its admin socket.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use nvmfd::admin::Request;
use nvmfd::ctl;

/// Query a running nvmfd through its admin socket.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The daemon's admin socket.
    #[arg(
        long,
        short = 's',
        env = "NVMFD_SOCKET",
        default_value = "/run/nvmfd/nvmfd.sock",
        global = true
    )]
    socket: PathBuf,
    /// Take the admin socket from this configuration file instead (its
    /// `daemon.admin_socket`, or the default where it names none), as the systemd unit's
    /// reload does; it wins over `--socket` and `NVMFD_SOCKET`.
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    /// Talk to the daemon with this process ID on the admin socket it listens on (found in
    /// /proc, and asked for its process ID), as the systemd unit's reload passes `$MAINPID`:
    /// a `daemon.admin_socket` edited since the daemon started takes effect at its restart,
    /// so the file's socket is not yet where it listens. It wins over the socket of
    /// `--config` (whose file must still be readable) and `--socket`; when none is found (or
    /// /proc cannot be read) they are used.
    #[arg(long, global = true)]
    pid: Option<u32>,
    /// Print the daemon's JSON answer instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for the daemon's answer. A change can take tens of seconds (a
    /// reactor that is busy, an RBD image to open on a slow cluster); one that times out here
    /// may still be applied.
    #[arg(long, default_value_t = 60, global = true)]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// What the daemon serves: reactors, listeners, subsystems.
    Status,
    /// Counters: reactors, admin socket, and the data path's.
    Stats {
        /// Prometheus text exposition format.
        #[arg(long, conflicts_with = "json")]
        prometheus: bool,
    },
    /// The configuration in force, defaults filled in (TOML; JSON with --json).
    Config,
    /// Live controllers: subsystem, host, queues and depths, keep-alive, commands served.
    Controllers,
    /// End one controller (its host may reconnect), or every controller of a host.
    Disconnect {
        /// Controller ID.
        #[arg(long, conflicts_with = "host", required_unless_present = "host")]
        cntlid: Option<u16>,
        /// Host NQN.
        #[arg(long)]
        host: Option<String>,
    },
    /// Read the configuration file again and apply what changed (as SIGHUP does).
    Reload,
    /// Add or remove a subsystem while the daemon serves.
    #[command(subcommand)]
    Subsystem(SubsystemCmd),
    /// Add, remove or resize a namespace while the daemon serves.
    #[command(subcommand)]
    Namespace(NamespaceCmd),
    /// Change which hosts may connect to a subsystem.
    #[command(subcommand)]
    Host(HostCmd),
    /// Add or remove a listener while the daemon serves.
    #[command(subcommand)]
    Listener(ListenerCmd),
}

#[derive(Subcommand, Debug)]
enum SubsystemCmd {
    /// Add a subsystem (no namespace yet; add them with `namespace add`).
    Add {
        /// Its NQN.
        nqn: String,
        /// Serial number (default: derived from the NQN).
        #[arg(long)]
        serial: Option<String>,
        /// Model number (default "nvmfd").
        #[arg(long)]
        model: Option<String>,
        /// Let any host connect.
        #[arg(long)]
        allow_any_host: bool,
        /// A host NQN allowed to connect (repeat for several).
        #[arg(long = "host")]
        hosts: Vec<String>,
    },
    /// Remove a subsystem: its controllers end.
    Remove {
        /// Its NQN.
        nqn: String,
    },
}

// Parsed once per run: the size of the largest variant costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum NamespaceCmd {
    /// Add a namespace: the keys of `[[subsystem.namespace]]` as options.
    Add {
        /// The subsystem's NQN.
        subsystem: String,
        /// NSID.
        #[arg(long)]
        nsid: u32,
        /// file, bdev, rbd, malloc or null.
        #[arg(long)]
        backend: String,
        /// File or block device (file, bdev).
        #[arg(long)]
        path: Option<PathBuf>,
        /// Size, e.g. 1GiB (malloc, null; rbd with --create).
        #[arg(long)]
        size: Option<String>,
        /// Logical block size: 512 or 4096.
        #[arg(long)]
        block_size: Option<String>,
        /// Refuse writes.
        #[arg(long)]
        read_only: bool,
        /// UUID reported to hosts.
        #[arg(long)]
        uuid: Option<String>,
        /// NGUID reported to hosts (32 hex digits).
        #[arg(long)]
        nguid: Option<String>,
        /// RADOS pool (rbd).
        #[arg(long)]
        pool: Option<String>,
        /// Image (rbd).
        #[arg(long)]
        image: Option<String>,
        /// RADOS namespace (rbd).
        #[arg(long)]
        rados_namespace: Option<String>,
        /// Ceph configuration file (rbd).
        #[arg(long)]
        ceph_conf: Option<PathBuf>,
        /// cephx user without `client.` (rbd).
        #[arg(long)]
        client_id: Option<String>,
        /// Create the image of --size when missing (rbd).
        #[arg(long)]
        create: bool,
    },
    /// Remove a namespace: I/O in flight completes, hosts are told.
    Remove {
        /// The subsystem's NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
    },
    /// Resize a namespace (hosts are told): to --size, or without it to what its file,
    /// device or image measures now.
    Resize {
        /// The subsystem's NQN.
        subsystem: String,
        /// NSID.
        nsid: u32,
        /// The new size, e.g. 2GiB.
        #[arg(long)]
        size: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum HostCmd {
    /// Allow a host NQN on a subsystem.
    Add {
        /// The subsystem's NQN.
        subsystem: String,
        /// The host's NQN.
        host: String,
    },
    /// Take a host NQN off a subsystem: its controllers there end.
    Remove {
        /// The subsystem's NQN.
        subsystem: String,
        /// The host's NQN.
        host: String,
    },
    /// Let any host connect (on), or only the listed ones (off).
    AllowAny {
        /// The subsystem's NQN.
        subsystem: String,
        /// on or off.
        #[arg(value_parser = ["on", "off"])]
        state: String,
    },
}

#[derive(Subcommand, Debug)]
enum ListenerCmd {
    /// Listen on another address.
    Add {
        /// IP address.
        address: std::net::IpAddr,
        /// Port.
        #[arg(long, default_value_t = 4420)]
        port: u16,
        /// soft or ibverbs.
        #[arg(long, default_value = "ibverbs")]
        provider: String,
    },
    /// Stop listening on an address: its connections end.
    Remove {
        /// IP address.
        address: std::net::IpAddr,
        /// Port.
        #[arg(long, default_value_t = 4420)]
        port: u16,
        /// soft or ibverbs: needed only when one listener of each shares the address and
        /// port.
        #[arg(long)]
        provider: Option<String>,
    },
}

/// A request from JSON `v` (the daemon's own types check what the options say).
fn from_json(v: serde_json::Value) -> Result<Request, String> {
    serde_json::from_value(v).map_err(|e| e.to_string())
}

/// Drops the keys whose value is null (options not given: the defaults apply).
fn present(mut v: serde_json::Value) -> serde_json::Value {
    if let Some(o) = v.as_object_mut() {
        o.retain(|_, x| !x.is_null() && *x != serde_json::Value::Bool(false));
    }
    v
}

fn request_of(cmd: &Command) -> Result<Request, String> {
    use serde_json::json;
    Ok(match cmd {
        Command::Status => Request::Status {},
        Command::Stats { .. } => Request::Stats {},
        Command::Config => Request::Config {},
        Command::Controllers => Request::Controllers {},
        Command::Disconnect { cntlid, host } => Request::Disconnect {
            cntlid: *cntlid,
            host: host.clone(),
        },
        Command::Reload => Request::Reload {},
        Command::Subsystem(SubsystemCmd::Add {
            nqn,
            serial,
            model,
            allow_any_host,
            hosts,
        }) => from_json(json!({
            "request": "add_subsystem",
            "subsystem": present(json!({
                "nqn": nqn, "serial": serial, "model": model,
                "allow_any_host": allow_any_host, "hosts": hosts,
            })),
        }))?,
        Command::Subsystem(SubsystemCmd::Remove { nqn }) => {
            Request::RemoveSubsystem { nqn: nqn.clone() }
        }
        Command::Namespace(NamespaceCmd::Add {
            subsystem,
            nsid,
            backend,
            path,
            size,
            block_size,
            read_only,
            uuid,
            nguid,
            pool,
            image,
            rados_namespace,
            ceph_conf,
            client_id,
            create,
        }) => from_json(json!({
            "request": "add_namespace",
            "subsystem": subsystem,
            "namespace": present(json!({
                "nsid": nsid, "backend": backend, "path": path, "size": size,
                "block_size": block_size, "read_only": read_only, "uuid": uuid,
                "nguid": nguid, "pool": pool, "image": image, "namespace": rados_namespace,
                "ceph_conf": ceph_conf, "client_id": client_id, "create": create,
            })),
        }))?,
        Command::Namespace(NamespaceCmd::Remove { subsystem, nsid }) => Request::RemoveNamespace {
            subsystem: subsystem.clone(),
            nsid: *nsid,
        },
        Command::Namespace(NamespaceCmd::Resize {
            subsystem,
            nsid,
            size,
        }) => from_json(present(json!({
            "request": "resize_namespace", "subsystem": subsystem, "nsid": nsid, "size": size,
        })))?,
        Command::Host(HostCmd::Add { subsystem, host }) => Request::AddHost {
            subsystem: subsystem.clone(),
            host: host.clone(),
        },
        Command::Host(HostCmd::Remove { subsystem, host }) => Request::RemoveHost {
            subsystem: subsystem.clone(),
            host: host.clone(),
        },
        Command::Host(HostCmd::AllowAny { subsystem, state }) => Request::AllowAnyHost {
            subsystem: subsystem.clone(),
            allow: state == "on",
        },
        Command::Listener(ListenerCmd::Add {
            address,
            port,
            provider,
        }) => from_json(json!({
            "request": "add_listener",
            "listener": { "address": address, "port": port, "provider": provider },
        }))?,
        Command::Listener(ListenerCmd::Remove {
            address,
            port,
            provider,
        }) => from_json(present(json!({
            "request": "remove_listener",
            "address": address,
            "port": port,
            "provider": provider,
        })))?,
    })
}

/// The admin socket a configuration file names. Only that key is read: a file the daemon
/// would refuse (what a reload is to report) still names its socket.
fn socket_of(path: &std::path::Path) -> Result<PathBuf, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let doc: toml::Table = toml::from_str(&text)
        .map_err(|e| format!("{} is not TOML: {}", path.display(), e.message()))?;
    match doc.get("daemon").and_then(|d| d.get("admin_socket")) {
        None => Ok(nvmfd_config::defaults::admin_socket()),
        Some(toml::Value::String(s)) => Ok(PathBuf::from(s)),
        Some(_) => Err(format!(
            "{}: daemon.admin_socket is not a path",
            path.display()
        )),
    }
}

/// The admin socket process `pid` listens on: of the Unix sockets it listens on (its
/// descriptors and `/proc/net/unix`), `prefer` first, the one whose `status` answers with
/// that process ID (a library in the daemon, librados with an `admin socket` in ceph.conf,
/// may listen on one of its own).
fn socket_of_pid(pid: u32, prefer: Option<&std::path::Path>) -> Option<PathBuf> {
    let inodes: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .ok()?
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .filter_map(|l| {
            l.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        })
        .collect();
    // Num RefCount Protocol Flags Type St Inode Path (the path last, and it may hold
    // spaces); Flags 00010000: listening.
    let table = std::fs::read_to_string("/proc/net/unix").ok()?;
    let mut listening: Vec<PathBuf> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (flags, inode) = (f.get(3)?, f.get(6)?.parse::<u64>().ok()?);
            let path = &line[line.find(" /")? + 1..];
            (*flags == "00010000" && inodes.contains(&inode)).then(|| PathBuf::from(path))
        })
        .collect();
    if let Some(p) = prefer {
        if let Some(i) = listening.iter().position(|l| l == p) {
            let first = listening.remove(i);
            listening.insert(0, first);
        }
    }
    listening.into_iter().find(|socket| {
        ctl::request(socket, &Request::Status {}, Duration::from_secs(5))
            .is_ok_and(|status| status["pid"].as_u64() == Some(u64::from(pid)))
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let req = match request_of(&cli.command) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("nvmfctl: {e}");
            return ExitCode::from(2);
        }
    };
    let socket = match &cli.config {
        Some(path) => match socket_of(path) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("nvmfctl: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => cli.socket.clone(),
    };
    let socket = cli
        .pid
        .and_then(|pid| socket_of_pid(pid, Some(&socket)))
        .unwrap_or(socket);
    let mut data = match ctl::request(&socket, &req, Duration::from_secs(cli.timeout)) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("nvmfctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    let text = if cli.json {
        serde_json::to_string_pretty(&data).unwrap_or_default() + "\n"
    } else {
        match cli.command {
            Command::Stats { prometheus: true } => ctl::render_prometheus(&data),
            Command::Config => {
                ctl::strip_nulls(&mut data);
                match toml::to_string(&data) {
                    Ok(t) => t,
                    Err(e) => {
                        eprintln!("nvmfctl: cannot print the configuration as TOML: {e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
            Command::Controllers => ctl::render_controllers(&data),
            Command::Status | Command::Stats { .. } => ctl::render_tables(&data),
            // A change: what it did, one line each.
            _ => data
                .get("changes")
                .or_else(|| data.get("disconnected"))
                .and_then(|v| v.as_array())
                .map(|a| {
                    a.iter()
                        .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_owned) + "\n")
                        .collect()
                })
                .unwrap_or_else(|| ctl::render_tables(&data)),
        }
    };
    print!("{text}");
    ExitCode::SUCCESS
}
