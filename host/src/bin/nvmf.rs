//! `nvmf`: nvmfd's NVMe over Fabrics host tool (RDMA: the `soft` provider over TCP, or
//! `ibverbs`).
//!
//!     nvmf discover --addr 127.0.0.1:4420
//!     nvmf identify --addr 127.0.0.1:4420 --nqn nqn.2024-01.io.nvmfd:ram0
//!     nvmf verify   --addr 127.0.0.1:4420 --nqn nqn.2024-01.io.nvmfd:ram0 --nsid 1

// Pattern bytes are masked to 8 bits before the cast.
#![allow(clippy::cast_possible_truncation)]

use std::net::SocketAddr;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use nvmf_host::RdmaQueue;
use nvmfd_nvme::host::{discovery_entry_text, AdminQueue, HostError, HostId, IoQueue};
use nvmfd_nvme::{wire, DISCOVERY_NQN};
use nvmfd_rdma::any::cm::CmChannel;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Provider {
    /// nvmfd's user-space provider over TCP.
    Soft,
    /// An RDMA device through rdma-core.
    Ibverbs,
}

/// nvmfd's NVMe over Fabrics host tool.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// The target's address and port.
    #[arg(long, global = true, default_value = "127.0.0.1:4420")]
    addr: SocketAddr,
    /// RDMA provider.
    #[arg(long, global = true, value_enum, default_value = "soft")]
    provider: Provider,
    /// This host's NQN.
    #[arg(
        long,
        global = true,
        default_value = "nqn.2014-08.org.nvmexpress:uuid:6e766d66-0000-4000-8000-000000000001"
    )]
    hostnqn: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List the subsystems the target offers this host.
    Discover,
    /// Show a subsystem's controller and namespaces.
    Identify {
        /// Subsystem NQN.
        #[arg(long)]
        nqn: String,
    },
    /// Write patterns of every size from one block to the largest transfer, read them back and
    /// compare (destroys the data where it writes: the first 16 MiB of the namespace).
    Verify {
        /// Subsystem NQN.
        #[arg(long)]
        nqn: String,
        /// Namespace.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
    },
}

fn channel(p: Provider) -> Result<CmChannel, String> {
    match p {
        Provider::Soft => {
            let f = nvmfd_rdma::soft::Fabric::networked();
            f.add_device("0.0.0.0".parse().map_err(|_| "address")?)
                .map_err(|e| e.to_string())?;
            Ok(CmChannel::Soft(
                nvmfd_rdma::soft::cm::CmChannel::new(&f).map_err(|e| e.to_string())?,
            ))
        }
        Provider::Ibverbs => Ok(CmChannel::Verbs(
            nvmfd_rdma::ibverbs::cm::CmChannel::new().map_err(|e| e.to_string())?,
        )),
    }
}

fn queue(cli: &Cli, qid: u16, sqsize: u16) -> Result<RdmaQueue, String> {
    RdmaQueue::connect(
        channel(cli.provider)?,
        cli.addr,
        qid,
        sqsize,
        4096,
        128 * 1024,
    )
    .map_err(|e| e.to_string())
}

fn admin(cli: &Cli, nqn: &str, host: &HostId) -> Result<AdminQueue<RdmaQueue>, String> {
    let mut a = AdminQueue::connect(queue(cli, 0, 31)?, host, nqn, 31, 30_000)
        .map_err(|e: HostError| e.to_string())?;
    a.enable().map_err(|e| e.to_string())?;
    Ok(a)
}

fn run(cli: &Cli) -> Result<(), String> {
    let host = HostId {
        nqn: cli.hostnqn.clone(),
        id: [0x6e; 16],
    };
    match &cli.command {
        Command::Discover => {
            let mut d = admin(cli, DISCOVERY_NQN, &host)?;
            for e in d.discover().map_err(|e| e.to_string())? {
                let (nqn, addr, port) = discovery_entry_text(&e);
                println!("{nqn}  rdma {addr}:{port}");
            }
        }
        Command::Identify { nqn } => {
            let mut a = admin(cli, nqn, &host)?;
            let id = a.identify_controller().map_err(|e| e.to_string())?;
            let s = |b: &[u8]| wire::get_str(b).unwrap_or("?").to_owned();
            println!(
                "controller {}  serial {}  model {}  firmware {}  MDTS {} KiB",
                id.cntlid.get(),
                s(&id.sn),
                s(&id.mn),
                s(&id.fr),
                4u32 << id.mdts
            );
            for nsid in a.active_namespaces(0).map_err(|e| e.to_string())? {
                let ns = a.identify_namespace(nsid).map_err(|e| e.to_string())?;
                let bs = 1u64 << ns.lbaf[0].lbads;
                println!(
                    "namespace {nsid}: {} blocks of {bs} bytes ({} MiB){}",
                    ns.nsze.get(),
                    (ns.nsze.get() * bs) >> 20,
                    if ns.nsattr & 1 == 1 {
                        ", read-only"
                    } else {
                        ""
                    }
                );
            }
            let _ = a.shutdown();
        }
        Command::Verify { nqn, nsid } => {
            let mut a = admin(cli, nqn, &host)?;
            let ns = a.identify_namespace(*nsid).map_err(|e| e.to_string())?;
            let bs = 1usize << ns.lbaf[0].lbads;
            a.set_queue_count(1).map_err(|e| e.to_string())?;
            let mut io = IoQueue::connect(queue(cli, 1, 63)?, &host, nqn, a.cntlid, 1, 63)
                .map_err(|e| e.to_string())?;
            let (mut len, mut lba, mut n) = (bs, 0u64, 0);
            while len <= 128 * 1024 {
                let data: Vec<u8> = (0..len)
                    .map(|i| ((i as u64 ^ lba).wrapping_mul(31) & 0xff) as u8)
                    .collect();
                let nlb = u32::try_from(len / bs).map_err(|e| e.to_string())?;
                io.write(*nsid, lba, nlb, &data, false)
                    .map_err(|e| format!("write {len} bytes at LBA {lba}: {e}"))?;
                let mut back = vec![0u8; len];
                io.read(*nsid, lba, nlb, &mut back)
                    .map_err(|e| format!("read {len} bytes at LBA {lba}: {e}"))?;
                if back != data {
                    return Err(format!("data differs: {len} bytes at LBA {lba}"));
                }
                lba += u64::from(nlb);
                len *= 2;
                n += 1;
            }
            io.flush(*nsid).map_err(|e| e.to_string())?;
            println!("verified: {n} writes read back intact, {bs} B to 128 KiB, namespace {nsid} of {nqn}");
            let _ = a.shutdown();
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nvmf: {e}");
            ExitCode::FAILURE
        }
    }
}
