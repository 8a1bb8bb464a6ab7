//! The host backend: CPU tensors in shared memory, moved over TCP between
//! agents.
//!
//! Each rank of a transfer listens on its pod's address (its endpoint).
//! At `connect` every rank connects to each peer any flow of the plan pairs
//! it with (its parents and children in the flows' trees): the higher rank
//! of a pair connects to the lower one and says hello (magic, transfer id,
//! rank). A hello is taken only from a connection whose peer address is
//! the IP the plan gives the rank it claims ([`Rank::ip`]; IPv4-mapped IPv6
//! addresses compare as IPv4): every member of a quorum sees the whole plan,
//! its transfer id and endpoints, so without that check any of them could
//! claim another rank and receive that rank's flows. A broadcast runs down
//! a tree of the group (`fanout` children per node,
//! [`crate::transport::tree`]), cut through: a node forwards each
//! piece to its children as soon as it has read it. It ends with acks
//! flowing back up, so a broadcast returns on the root when every member has
//! the bytes: one round trip per collective, as NCCL's.
//!
//! A flow starts with a handshake ([`Comm::begin_flow`]): `READY` up the
//! tree once a node's whole subtree is in the flow, then `GO` down from the
//! root. Members of a flow may be busy with earlier flows of the plan
//! (many to many) for longer than the timeout; these waits tolerate that
//! for [`IDLE_FACTOR`] timeouts, as long as the peer's connection stays
//! open (a rank that fails closes its connections, ending its peers' waits
//! at once). Once every member is in the flow, the timeout bounds each read
//! and write.
//!
//! Every message starts with a header (magic, length); a length that is not
//! what this rank expects means the ranks disagree about the plan, and the
//! transfer fails rather than mixing tensors.
//!
//! Ranks that share a node ([`kt_types::tensor::Rank::node`], which the
//! agents report from `KT_NODE_NAME`) are planned together
//! ([`node_tree`]): a flow's tree crosses into each node once, to the
//! node's first member, which passes it on to the others of its node, as
//! NCCL keeps traffic between ranks of one host identity on P2P/SHM.
//!
//! [`Rank::ip`]: kt_types::tensor::Rank::ip

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kt_types::tensor::{BackendKind, Device, MemHandle, Placement, TransferPlan};

use crate::shm::{HostBuf, ShmRegion};
use crate::transport::{Backend, Comm, Endpoint, Region, TransportError, tree};

const HELLO_MAGIC: &[u8; 4] = b"KTH1";
const DATA_MAGIC: u32 = 0x4b54_4431; // "KTD1"
const ACK: u8 = 0xac;
const READY: u8 = 0x5e;
const GO: u8 = 0x60;
/// How many timeouts a rank waits, idle, for the members of a flow to be
/// done with their earlier flows (see the module docs).
pub const IDLE_FACTOR: u32 = 60;
/// Bytes read from a parent before they are forwarded.
const PIECE: usize = 4 << 20;
const MAX_ID: usize = 256;

/// CPU tensors in shared memory, over TCP.
#[derive(Debug, Clone)]
pub struct HostBackend {
    shm_dir: PathBuf,
    /// Listener ports tried first (a NetworkPolicy opens them); then any.
    ports: Vec<u16>,
}

impl HostBackend {
    /// Maps handles inside `shm_dir` only; listens on any free port.
    pub fn new(shm_dir: impl Into<PathBuf>) -> Self {
        HostBackend {
            shm_dir: shm_dir.into(),
            ports: Vec::new(),
        }
    }

    /// Listeners try these ports first (`KT_TENSOR_PORT`).
    pub fn with_ports(mut self, ports: Vec<u16>) -> Self {
        self.ports = ports;
        self
    }

    pub fn shm_dir(&self) -> &std::path::Path {
        &self.shm_dir
    }
}

/// The host backend's tree of one broadcast (`root` to `group`, `fanout`
/// children per node of the tree) over ranks whose nodes are `nodes`
/// (indexed by rank; empty: not known): this rank's parent and children.
///
/// Two levels: a [`tree`] from the root over each node's first member (the
/// root leads its own node; a rank of unknown node is a node of its own),
/// the only links between nodes, and within each node a [`tree`] from that
/// first member over the node's ranks. Without nodes it is [`tree`]'s.
pub fn node_tree(
    nodes: &[String],
    root: u32,
    group: &[u32],
    me: u32,
    fanout: u32,
) -> (Option<u32>, Vec<u32>) {
    let node = |r: u32| nodes.get(r as usize).map_or("", String::as_str);
    let mut order = Vec::with_capacity(group.len() + 1);
    order.push(root);
    order.extend(group.iter().copied().filter(|r| *r != root));
    if order.iter().all(|r| node(*r).is_empty()) {
        return tree(root, group, me, fanout);
    }
    if !order.contains(&me) {
        return (None, Vec::new());
    }
    // Each known node's first member in the tree's order leads it.
    let mut leader: HashMap<&str, u32> = HashMap::new();
    for r in &order {
        if !node(*r).is_empty() {
            leader.entry(node(*r)).or_insert(*r);
        }
    }
    let leads = |r: u32| node(r).is_empty() || leader.get(node(r)) == Some(&r);
    let leaders: Vec<u32> = order.iter().copied().filter(|r| leads(*r)).collect();
    let (mut parent, mut children) = if leads(me) {
        tree(root, &leaders, me, fanout)
    } else {
        (None, Vec::new())
    };
    if !node(me).is_empty() {
        let mates: Vec<u32> = order
            .iter()
            .copied()
            .filter(|r| node(*r) == node(me))
            .collect();
        let (p, c) = tree(mates[0], &mates, me, fanout);
        if mates[0] != me {
            parent = p;
        }
        children.extend(c);
    }
    (parent, children)
}

/// Where `plan` puts rank `me` among its nodes (see [`Placement`]): its
/// host identity, the other ranks of its node, and (host backend) the
/// peers of its [`node_tree`]s on its node and on others.
pub fn placement(plan: &TransferPlan, me: u32) -> Placement {
    let node = plan.node_of(me);
    let mut out = Placement {
        host: if node.is_empty() {
            String::new()
        } else {
            kt_types::tensor::node_host_id(node)
        },
        same_node: (0..plan.ranks.len() as u32)
            .filter(|r| *r != me && plan.same_node(me, *r))
            .collect(),
        ..Placement::default()
    };
    if plan.backend != BackendKind::Host {
        return out;
    }
    let nodes: Vec<String> = plan.ranks.iter().map(|r| r.node.clone()).collect();
    let mut peers = std::collections::BTreeSet::new();
    for f in &plan.flows {
        let (parent, children) = node_tree(&nodes, f.root, &f.group(), me, plan.fanout);
        peers.extend(parent.into_iter().chain(children));
    }
    for p in peers {
        if plan.same_node(me, p) {
            out.links_same_node += 1;
        } else {
            out.links_other_nodes += 1;
        }
    }
    out
}

fn host_only(what: &str, device: Device) -> TransportError {
    TransportError::Invalid(format!(
        "the host backend moves CPU tensors; {what} is on {device} (CUDA tensors move over NCCL)"
    ))
}

impl Backend for HostBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn map(&self, handle: &MemHandle, device: Device) -> Result<Box<dyn Region>, TransportError> {
        match (handle, device) {
            (MemHandle::Shm { path, offset, len }, Device::Cpu) => Ok(Box::new(ShmRegion::open(
                &self.shm_dir,
                path,
                *offset,
                *len,
            )?)),
            (_, d) => Err(host_only("a tensor", d)),
        }
    }

    fn alloc(&self, device: Device, len: u64) -> Result<Box<dyn Region>, TransportError> {
        if device != Device::Cpu {
            return Err(host_only("a staging buffer", device));
        }
        Ok(Box::new(HostBuf(vec![0; len as usize])))
    }

    fn copy(
        &self,
        dst: &mut dyn Region,
        dst_off: u64,
        src: &dyn Region,
        src_off: u64,
        len: u64,
    ) -> Result<(), TransportError> {
        use std::os::unix::fs::FileExt;
        let (s, d) = (src_off as usize, dst_off as usize);
        let n = len as usize;
        let failed = |e| TransportError::io("copying shared memory (was a file shrunk?)", e);
        // Shared memory is copied through its file, never through the
        // mapping: a file its owner shrank fails the copy (EFAULT, a short
        // read) instead of killing the agent with SIGBUS.
        if let Some((file, base)) = dst.shm_file() {
            let src = src
                .host()
                .and_then(|b| b.get(s..s + n))
                .ok_or_else(|| TransportError::Invalid("copy source out of range".into()))?;
            if d.checked_add(n).is_none_or(|end| end as u64 > dst.len()) {
                return Err(TransportError::Invalid(
                    "copy destination out of range".into(),
                ));
            }
            return file.write_all_at(src, base + dst_off).map_err(failed);
        }
        let dst = dst
            .host_mut()
            .and_then(|b| b.get_mut(d..d + n))
            .ok_or_else(|| TransportError::Invalid("copy destination out of range".into()))?;
        if let Some((file, base)) = src.shm_file() {
            if s.checked_add(n).is_none_or(|end| end as u64 > src.len()) {
                return Err(TransportError::Invalid("copy source out of range".into()));
            }
            return file.read_exact_at(dst, base + src_off).map_err(failed);
        }
        let src = src
            .host()
            .and_then(|b| b.get(s..s + n))
            .ok_or_else(|| TransportError::Invalid("copy source out of range".into()))?;
        dst.copy_from_slice(src);
        Ok(())
    }

    fn endpoint(&self, _id: &str, ip: &str) -> Result<Box<dyn Endpoint>, TransportError> {
        let ip: std::net::IpAddr = ip
            .parse()
            .map_err(|_| TransportError::Invalid(format!("{ip:?} is not an IP address")))?;
        let listener = match self
            .ports
            .iter()
            .find_map(|p| TcpListener::bind(SocketAddr::new(ip, *p)).ok())
        {
            Some(l) => l,
            None => {
                if !self.ports.is_empty() {
                    tracing::warn!(
                        "tensor ports ({}) taken; listening on one of the system's choosing, which a NetworkPolicy may block",
                        kt_types::env::TENSOR_PORT
                    );
                }
                TcpListener::bind(SocketAddr::new(ip, 0))
                    .map_err(|e| TransportError::io(format!("listening on {ip} for tensors"), e))?
            }
        };
        let addr = listener
            .local_addr()
            .map_err(|e| TransportError::io("tensor listener", e))?;
        Ok(Box::new(HostEndpoint { listener, addr }))
    }

    fn rendezvous(&self, _plan: &TransferPlan) -> Result<Option<String>, TransportError> {
        Ok(None)
    }

    fn connect(
        &self,
        plan: &TransferPlan,
        rank: u32,
        endpoint: Box<dyn Endpoint>,
        _rendezvous: Option<&str>,
        _device: Device,
        timeout: Duration,
    ) -> Result<Box<dyn Comm>, TransportError> {
        let endpoint = endpoint.into_any();
        let ep = endpoint.downcast::<HostEndpoint>().map_err(|_| {
            TransportError::Invalid("the host backend was given another backend's endpoint".into())
        })?;
        Ok(Box::new(HostComm::start(plan, rank, *ep, timeout)?))
    }
}

/// A bound listener, kept from before the plan is known until `connect`.
#[derive(Debug)]
pub struct HostEndpoint {
    listener: TcpListener,
    addr: SocketAddr,
}

impl Endpoint for HostEndpoint {
    fn address(&self) -> String {
        self.addr.to_string()
    }
    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any + Send> {
        self
    }
}

type Accepted = Arc<(Mutex<HashMap<u32, TcpStream>>, Condvar)>;

/// The ranks of one transfer over TCP.
#[derive(Debug)]
pub struct HostComm {
    id: String,
    rank: u32,
    /// Each rank's agent id and endpoint.
    peers: Vec<(String, String)>,
    /// Each rank's node (empty: not known): see [`node_tree`].
    nodes: Vec<String>,
    fanout: u32,
    timeout: Duration,
    conns: HashMap<u32, TcpStream>,
    accepted: Accepted,
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
    /// The IP the plan gives this rank: connections leave from it, since
    /// peers take a hello only from the IP of the rank it claims.
    ip: IpAddr,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl HostComm {
    fn start(
        plan: &TransferPlan,
        rank: u32,
        ep: HostEndpoint,
        timeout: Duration,
    ) -> Result<Self, TransportError> {
        if plan.id.is_empty() || plan.id.len() > MAX_ID {
            return Err(TransportError::Invalid(
                "transfer id empty or too long".into(),
            ));
        }
        if rank as usize >= plan.ranks.len() {
            return Err(TransportError::Invalid(format!(
                "rank {rank} is not in the plan"
            )));
        }
        let ips = plan
            .ranks
            .iter()
            .map(|r| {
                r.ip.parse::<IpAddr>()
                    .map(|ip| ip.to_canonical())
                    .map_err(|_| {
                        TransportError::Invalid(format!(
                            "rank {} of the plan has ip {:?}, not an IP address",
                            r.rank, r.ip
                        ))
                    })
            })
            .collect::<Result<Arc<[IpAddr]>, _>>()?;
        let own_ip = ips[rank as usize];
        let accepted: Accepted = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let (accepted, stop, id) = (accepted.clone(), stop.clone(), plan.id.clone());
            std::thread::Builder::new()
                .name("kt-tensor-accept".into())
                .spawn(move || accept_loop(ep.listener, &id, rank, ips, &accepted, &stop, timeout))
                .map_err(|e| TransportError::io("starting the tensor acceptor", e))?
        };
        let mut comm = HostComm {
            id: plan.id.clone(),
            rank,
            peers: plan
                .ranks
                .iter()
                .map(|r| (r.agent.clone(), r.endpoint.clone()))
                .collect(),
            nodes: plan.ranks.iter().map(|r| r.node.clone()).collect(),
            fanout: plan.fanout.max(1),
            timeout,
            conns: HashMap::new(),
            accepted,
            stop,
            addr: ep.addr,
            ip: own_ip,
            acceptor: Some(acceptor),
        };
        // Every connection the plan needs, now, while every rank is
        // connecting: later a peer may be busy with other flows.
        for peer in comm.peers_of(plan) {
            comm.conn(peer)?;
        }
        Ok(comm)
    }

    /// The ranks any flow of `plan` pairs this rank with, ascending.
    fn peers_of(&self, plan: &TransferPlan) -> Vec<u32> {
        let mut peers = std::collections::BTreeSet::new();
        for f in &plan.flows {
            let group = f.group();
            let (parent, children) = node_tree(&self.nodes, f.root, &group, self.rank, self.fanout);
            peers.extend(parent.into_iter().chain(children));
        }
        peers.into_iter().collect()
    }

    /// Reads one byte, `want`, from `peer`, waiting idle up to
    /// [`IDLE_FACTOR`] timeouts while its connection stays open.
    fn idle_byte(&mut self, peer: u32, want: u8, doing: &str) -> Result<(), TransportError> {
        let started = Instant::now();
        let limit = self.timeout * IDLE_FACTOR;
        loop {
            let mut b = [0u8; 1];
            let r = self.conn(peer)?.read(&mut b);
            match r {
                Ok(1) if b[0] == want => return Ok(()),
                Ok(1) => {
                    return Err(TransportError::Peer(format!(
                        "{} sent {:#04x} {doing} (ranks disagree about the plan)",
                        self.who(peer),
                        b[0]
                    )));
                }
                Ok(_) => {
                    return Err(self.failed(peer, doing, std::io::ErrorKind::UnexpectedEof.into()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) && started.elapsed() < limit => {}
                Err(e) => return Err(self.failed(peer, doing, e)),
            }
        }
    }

    fn send_byte(&mut self, peer: u32, b: u8, doing: &str) -> Result<(), TransportError> {
        let r = self.conn(peer)?.write_all(&[b]);
        r.map_err(|e| self.failed(peer, doing, e))
    }

    fn who(&self, rank: u32) -> String {
        match self.peers.get(rank as usize) {
            Some((agent, ep)) => format!("rank {rank} ({agent} at {ep})"),
            None => format!("rank {rank}"),
        }
    }

    /// The connection to `peer`, made now if needed.
    fn conn(&mut self, peer: u32) -> Result<&mut TcpStream, TransportError> {
        if !self.conns.contains_key(&peer) {
            let s = if peer < self.rank {
                self.dial(peer)?
            } else {
                self.await_peer(peer)?
            };
            self.conns.insert(peer, s);
        }
        Ok(self.conns.get_mut(&peer).expect("inserted above"))
    }

    fn dial(&self, peer: u32) -> Result<TcpStream, TransportError> {
        let ep = &self.peers[peer as usize].1;
        let addr = ep
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| TransportError::Invalid(format!("{}: bad endpoint", self.who(peer))))?;
        let deadline = Instant::now() + self.timeout;
        // The peer may not have bound its listener's accept loop yet when
        // the plan reaches us first: retry refusals until the deadline.
        let mut s = loop {
            match connect_from(self.ip, &addr, self.timeout) {
                Ok(s) => break s,
                Err(e)
                    if Instant::now() < deadline
                        && e.kind() == std::io::ErrorKind::ConnectionRefused =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(TransportError::io(
                        format!("connecting to {}", self.who(peer)),
                        e,
                    ));
                }
            }
        };
        setup(&s, self.timeout).map_err(|e| TransportError::io("tensor socket", e))?;
        s.write_all(&hello(&self.id, self.rank))
            .map_err(|e| self.failed(peer, "saying hello to", e))?;
        Ok(s)
    }

    fn await_peer(&self, peer: u32) -> Result<TcpStream, TransportError> {
        let (lock, cv) = &*self.accepted;
        let deadline = Instant::now() + self.timeout;
        let mut map = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(s) = map.remove(&peer) {
                return Ok(s);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(TransportError::Timeout(format!(
                    "{} did not connect within {:?}",
                    self.who(peer),
                    self.timeout
                )));
            }
            map = cv
                .wait_timeout(map, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn failed(&self, peer: u32, doing: &str, e: std::io::Error) -> TransportError {
        let who = self.who(peer);
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                TransportError::Timeout(format!("{doing} {who}: nothing for {:?}", self.timeout))
            }
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::BrokenPipe => TransportError::Peer(format!(
                "{doing} {who}: the connection broke mid-transfer ({e})"
            )),
            _ => TransportError::io(format!("{doing} {who}"), e),
        }
    }
}

fn setup(s: &TcpStream, timeout: Duration) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))
}

/// A connection to `to` leaving from `from` (the rank's own IP: a pod has
/// one, but a loopback testbed gives each pod its own 127.x address and the
/// kernel would pick 127.0.0.1). Another address family, or an IP this host
/// does not have, connects from where the kernel's route says, as before.
fn connect_from(from: IpAddr, to: &SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    use socket2::{Domain, Protocol, Socket, Type};
    let sock = Socket::new(Domain::for_address(*to), Type::STREAM, Some(Protocol::TCP))?;
    if from.is_ipv4() == to.is_ipv4() {
        match sock.bind(&SocketAddr::new(from, 0).into()) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                tracing::debug!(%from, "not an address of this host; connecting from the route's");
            }
            Err(e) => return Err(e),
        }
    }
    sock.connect_timeout(&(*to).into(), timeout)?;
    Ok(sock.into())
}

/// Accepts the higher ranks' connections of transfer `id` for rank `me`;
/// `ips`: each rank's IP (canonical), which its connection must come from.
fn accept_loop(
    listener: TcpListener,
    id: &str,
    me: u32,
    ips: Arc<[IpAddr]>,
    accepted: &Accepted,
    stop: &AtomicBool,
    timeout: Duration,
) {
    // Hellos are read on threads of their own (a few at a time), so a
    // connection that says nothing never holds up the peers behind it.
    let reading = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let Ok(s) = conn else { continue };
        if reading.fetch_add(1, Ordering::AcqRel) >= MAX_HELLOS {
            reading.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(transfer = %id, "too many tensor connections saying nothing; refused one");
            continue;
        }
        let (accepted, reading, id, ips) = (
            accepted.clone(),
            reading.clone(),
            id.to_owned(),
            ips.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("kt-tensor-hello".into())
            .spawn(move || {
                take_hello(s, &id, me, &ips, &accepted, timeout);
                reading.fetch_sub(1, Ordering::AcqRel);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not read a tensor hello");
        }
    }
}

/// Most hellos read at once by one listener.
const MAX_HELLOS: usize = 64;

/// Reads a connection's hello and hands it to the rank waiting for it, if
/// it comes from that rank's IP (`ips`, canonical, by rank); anything else
/// is closed.
fn take_hello(
    mut s: TcpStream,
    id: &str,
    me: u32,
    ips: &[IpAddr],
    accepted: &Accepted,
    timeout: Duration,
) {
    let hello = setup(&s, timeout.min(Duration::from_secs(10))).and_then(|()| read_hello(&mut s));
    let world = ips.len() as u32;
    match hello {
        Ok((their_id, rank)) if their_id == id && rank > me && rank < world => {
            let want = ips[rank as usize];
            let from = s.peer_addr().map(|a| a.ip().to_canonical());
            if from.as_ref().ok() != Some(&want) {
                tracing::warn!(
                    transfer = %id,
                    rank,
                    expected = %want,
                    from = ?from,
                    "refused a tensor connection claiming a rank from another address than the rank's"
                );
                return;
            }
            if setup(&s, timeout).is_err() {
                return;
            }
            let (lock, cv) = &**accepted;
            lock.lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(rank, s);
            cv.notify_all();
        }
        Ok((their_id, rank)) => {
            tracing::warn!(transfer = %id, their_id, rank, "refused a tensor connection of another transfer or rank");
        }
        Err(e) => tracing::debug!(error = %e, "unreadable tensor hello"),
    }
}

/// What rank `rank` of transfer `id` says first on a connection it dials.
fn hello(id: &str, rank: u32) -> Vec<u8> {
    let mut hello = Vec::with_capacity(4 + 2 + id.len() + 4);
    hello.extend_from_slice(HELLO_MAGIC);
    hello.extend_from_slice(&(id.len() as u16).to_be_bytes());
    hello.extend_from_slice(id.as_bytes());
    hello.extend_from_slice(&rank.to_be_bytes());
    hello
}

fn read_hello(s: &mut TcpStream) -> std::io::Result<(String, u32)> {
    let mut head = [0u8; 6];
    s.read_exact(&mut head)?;
    if &head[..4] != HELLO_MAGIC {
        return Err(std::io::Error::other("not a kt tensor hello"));
    }
    let n = u16::from_be_bytes([head[4], head[5]]) as usize;
    if n > MAX_ID {
        return Err(std::io::Error::other("transfer id too long"));
    }
    let mut id = vec![0u8; n];
    s.read_exact(&mut id)?;
    let mut rank = [0u8; 4];
    s.read_exact(&mut rank)?;
    Ok((
        String::from_utf8_lossy(&id).into_owned(),
        u32::from_be_bytes(rank),
    ))
}

impl Drop for HostComm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the acceptor blocked in accept().
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

impl Comm for HostComm {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.peers.len() as u32
    }

    fn broadcast(
        &mut self,
        root: u32,
        group: &[u32],
        buf: &mut dyn Region,
        offset: u64,
        len: u64,
    ) -> Result<(), TransportError> {
        let (o, n) = (offset as usize, len as usize);
        let size = buf.len();
        let Some(bytes) = buf.host_mut().and_then(|b| b.get_mut(o..o + n)) else {
            return Err(TransportError::Invalid(format!(
                "broadcast of {len} bytes at {offset} is outside a buffer of {size} bytes (or not host memory)"
            )));
        };
        self.broadcast_slices(root, group, &mut [bytes])
    }

    fn gathers(&self) -> bool {
        true
    }

    fn begin_flow(&mut self, root: u32, group: &[u32]) -> Result<(), TransportError> {
        let (parent, children) = node_tree(&self.nodes, root, group, self.rank, self.fanout);
        for c in &children {
            self.idle_byte(*c, READY, "waiting for the subtree of")?;
        }
        if let Some(p) = parent {
            self.send_byte(p, READY, "telling readiness to")?;
            self.idle_byte(p, GO, "waiting for the start of the flow from")?;
        }
        for c in &children {
            self.send_byte(*c, GO, "starting the flow for")?;
        }
        Ok(())
    }

    fn broadcast_parts(
        &mut self,
        root: u32,
        group: &[u32],
        parts: &mut [&mut dyn Region],
    ) -> Result<(), TransportError> {
        let mut slices = Vec::with_capacity(parts.len());
        for p in parts.iter_mut() {
            let device = p.device();
            slices.push(
                p.host_mut()
                    .ok_or_else(|| host_only("a packed tensor", device))?,
            );
        }
        self.broadcast_slices(root, group, &mut slices)
    }
}

impl HostComm {
    /// One collective over `parts` taken end to end: read from the parent
    /// straight into them, forwarded to the children as it comes (small
    /// parts gathered into one write), acknowledged up the tree.
    fn broadcast_slices(
        &mut self,
        root: u32,
        group: &[u32],
        parts: &mut [&mut [u8]],
    ) -> Result<(), TransportError> {
        let (parent, children) = node_tree(&self.nodes, root, group, self.rank, self.fanout);
        if parent.is_none() && self.rank != root {
            return Err(TransportError::Invalid(format!(
                "rank {} is not in the group of this broadcast",
                self.rank
            )));
        }
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        for c in &children {
            self.conn(*c)?;
        }
        let mut header = [0u8; 12];
        header[..4].copy_from_slice(&DATA_MAGIC.to_be_bytes());
        header[4..].copy_from_slice(&total.to_be_bytes());
        for c in &children {
            let r = self.conns.get_mut(c).expect("connected").write_all(&header);
            r.map_err(|e| self.failed(*c, "sending to", e))?;
        }
        if let Some(p) = parent {
            let mut got = [0u8; 12];
            let r = self.conn(p)?.read_exact(&mut got);
            r.map_err(|e| self.failed(p, "receiving from", e))?;
            if got != header {
                return Err(TransportError::Peer(format!(
                    "{} sent a broadcast this rank does not expect (ranks disagree about the plan)",
                    self.who(p)
                )));
            }
        }
        let mut i = 0;
        while i < parts.len() {
            if parts[i].len() > PIECE {
                // A large part: piece by piece, each forwarded once read.
                let n = parts[i].len();
                let mut done = 0;
                while done < n {
                    let end = (done + PIECE).min(n);
                    self.relay(parent, &children, &mut [&mut parts[i][done..end]])?;
                    done = end;
                }
                i += 1;
            } else {
                // A run of small parts, up to a piece in all: one gathered write.
                let mut j = i;
                let mut size = 0;
                while j < parts.len() && size + parts[j].len() <= PIECE {
                    size += parts[j].len();
                    j += 1;
                }
                self.relay(parent, &children, &mut parts[i..j])?;
                i = j;
            }
        }
        for c in &children {
            let mut ack = [0u8; 1];
            let r = self
                .conns
                .get_mut(c)
                .expect("connected")
                .read_exact(&mut ack);
            r.map_err(|e| self.failed(*c, "waiting for the acknowledgement of", e))?;
            if ack[0] != ACK {
                return Err(TransportError::Peer(format!(
                    "{} answered a broadcast with garbage",
                    self.who(*c)
                )));
            }
        }
        if let Some(p) = parent {
            let r = self.conns.get_mut(&p).expect("connected").write_all(&[ACK]);
            r.map_err(|e| self.failed(p, "acknowledging to", e))?;
        }
        Ok(())
    }

    /// Reads `run` from the parent (if any), then writes it to each child.
    fn relay(
        &mut self,
        parent: Option<u32>,
        children: &[u32],
        run: &mut [&mut [u8]],
    ) -> Result<(), TransportError> {
        if let Some(p) = parent {
            for part in run.iter_mut() {
                let r = self.conns.get_mut(&p).expect("connected").read_exact(part);
                r.map_err(|e| self.failed(p, "receiving from", e))?;
            }
        }
        for c in children {
            let r = write_all_gathered(self.conns.get_mut(c).expect("connected"), run);
            r.map_err(|e| self.failed(*c, "sending to", e))?;
        }
        Ok(())
    }
}

/// Writes every byte of `parts`, in order, with vectored writes.
fn write_all_gathered(w: &mut TcpStream, parts: &[&mut [u8]]) -> std::io::Result<()> {
    let mut slices: Vec<std::io::IoSlice<'_>> = parts
        .iter()
        .filter(|p| !p.is_empty())
        .map(|p| std::io::IoSlice::new(p))
        .collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        match w.write_vectored(rest) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => std::io::IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kt_types::Key;
    use kt_types::tensor::{Flow, Packing, Rank};

    /// Runs `n` ranks of one plan on 127.0.0.1, each on its own thread:
    /// `configure` adjusts the plan (made by [`plan_of`], fanout 2), then
    /// every rank connects with `timeout` and runs `f`; their results in
    /// rank order.
    pub(crate) fn on_every_rank<T: Send>(
        n: u32,
        configure: impl FnOnce(&mut TransferPlan),
        timeout: Duration,
        f: impl Fn(usize, &HostBackend, &TransferPlan, Box<dyn Comm>) -> T + Sync,
    ) -> Vec<T> {
        let b = HostBackend::new("/dev/shm");
        let eps: Vec<Box<dyn Endpoint>> = (0..n)
            .map(|_| b.endpoint("t", "127.0.0.1").unwrap())
            .collect();
        let addrs: Vec<String> = eps.iter().map(|e| e.address()).collect();
        let mut plan = plan_of(n, 2, &addrs);
        configure(&mut plan);
        std::thread::scope(|s| {
            let hs: Vec<_> = eps
                .into_iter()
                .enumerate()
                .map(|(r, ep)| {
                    let (b, plan, f) = (&b, &plan, &f);
                    s.spawn(move || {
                        let c = b
                            .connect(plan, r as u32, ep, None, Device::Cpu, timeout)
                            .unwrap();
                        f(r, b, plan, c)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// Connects `n` ranks of one plan on 127.0.0.1 (each in its thread).
    pub(crate) fn plan_of(n: u32, fanout: u32, eps: &[String]) -> TransferPlan {
        TransferPlan {
            id: "t-test".into(),
            backend: BackendKind::Host,
            ranks: (0..n)
                .map(|r| Rank {
                    rank: r,
                    agent: format!("pod-{r}"),
                    member: String::new(),
                    node: String::new(),
                    ip: "127.0.0.1".into(),
                    endpoint: eps[r as usize].clone(),
                })
                .collect(),
            flows: vec![Flow {
                key: Key::parse("k").unwrap(),
                version: "v".into(),
                root: 0,
                receivers: (1..n).collect(),
                tensors: vec![],
            }],
            packing: Packing::default(),
            fanout,
        }
    }

    #[test]
    fn a_tree_broadcast_reaches_every_rank() {
        let len = 9 << 20; // more than two pieces
        let results = on_every_rank(
            7,
            |_| {},
            Duration::from_secs(20),
            |r, _, _, mut c| {
                let mut buf = HostBuf(vec![0; len + 16]);
                if r == 2 {
                    // root 2 of a group without rank 6
                    for (i, x) in buf.0.iter_mut().enumerate() {
                        *x = (i % 251) as u8;
                    }
                }
                if r != 6 {
                    c.broadcast(2, &[0, 1, 2, 3, 4, 5], &mut buf, 16, len as u64)
                        .unwrap();
                }
                buf.0
            },
        );
        for (r, buf) in results.iter().enumerate() {
            if r == 6 {
                assert!(buf.iter().all(|x| *x == 0));
                continue;
            }
            assert!(
                buf[..16].iter().all(|x| *x == 0) || r == 2,
                "rank {r} wrote before offset"
            );
            assert!(
                buf[16..]
                    .iter()
                    .enumerate()
                    .all(|(i, x)| *x == ((i + 16) % 251) as u8),
                "rank {r} got other bytes"
            );
        }
    }

    fn nodes(of: &[&str]) -> Vec<String> {
        of.iter().map(|n| n.to_string()).collect()
    }

    /// Every rank of the group once, each child's parent the rank that
    /// lists it; the links between nodes (a rank of unknown node a node of
    /// its own).
    fn check_tree(nodes: &[String], root: u32, group: &[u32], fanout: u32) -> usize {
        let mut seen = vec![0; nodes.len()];
        let mut across = 0;
        let known = |r: u32| !nodes[r as usize].is_empty();
        let mut members: Vec<u32> = group.iter().copied().chain([root]).collect();
        members.sort_unstable();
        members.dedup();
        for me in members {
            let (parent, children) = node_tree(nodes, root, group, me, fanout);
            assert_eq!(parent.is_none(), me == root, "rank {me}");
            for c in children {
                seen[c as usize] += 1;
                assert_eq!(node_tree(nodes, root, group, c, fanout).0, Some(me));
                if !(known(me) && nodes[me as usize] == nodes[c as usize]) {
                    across += 1;
                }
            }
        }
        seen[root as usize] += 1;
        for r in group.iter().chain([&root]) {
            assert_eq!(seen[*r as usize], 1, "rank {r}: {seen:?}");
        }
        across
    }

    /// Two nodes, two pods each: the tree crosses from the root's node to
    /// the other node once, and that node's first member passes the data on
    /// to its other member.
    #[test]
    fn trees_cross_into_each_node_once() {
        let two_by_two = nodes(&["node-a", "node-a", "node-b", "node-b"]);
        let group = [0, 1, 2, 3];
        assert_eq!(node_tree(&two_by_two, 0, &group, 0, 50), (None, vec![2, 1]));
        assert_eq!(node_tree(&two_by_two, 0, &group, 1, 50), (Some(0), vec![]));
        assert_eq!(node_tree(&two_by_two, 0, &group, 2, 50), (Some(0), vec![3]));
        assert_eq!(node_tree(&two_by_two, 0, &group, 3, 50), (Some(2), vec![]));
        assert_eq!(check_tree(&two_by_two, 0, &group, 50), 1);
        // Without nodes: the plain tree (the root to every other rank).
        let none = nodes(&["", "", "", ""]);
        assert_eq!(node_tree(&none, 0, &group, 0, 50), (None, vec![1, 2, 3]));
        assert_eq!(check_tree(&none, 0, &group, 50), 3);
        // Interleaved ranks, any root, fanout, and ranks of unknown node.
        let mixed = nodes(&["a", "b", "c", "a", "b", "", "c", "a", "b", "", "a", "c"]);
        let all: Vec<u32> = (0..12).collect();
        let none12 = vec![String::new(); 12];
        for fanout in [1, 2, 3, 50] {
            for root in [0, 5, 7] {
                // Three nodes and two ranks of none: four links across.
                assert_eq!(check_tree(&mixed, root, &all, fanout), 4, "root {root}");
                for me in 0..12 {
                    assert_eq!(
                        node_tree(&none12, root, &all, me, fanout),
                        tree(root, &all, me, fanout)
                    );
                }
            }
            // A subgroup without rank 3 and 11.
            let sub = [0, 1, 2, 4, 5, 6, 7, 8, 9, 10];
            assert_eq!(check_tree(&mixed, 1, &sub, fanout), 4);
        }
        assert_eq!(node_tree(&mixed, 0, &[0, 3], 7, 2), (None, vec![]));
    }

    /// The placement a rank reports: its host identity, its node's other
    /// ranks, and its tree's links within and across nodes.
    #[test]
    fn placements_count_links_within_and_across_nodes() {
        let mut plan = plan_of(4, 50, &vec![String::new(); 4]);
        for (r, n) in ["node-a", "node-a", "node-b", "node-b"].iter().enumerate() {
            plan.ranks[r].node = n.to_string();
        }
        let expect = |host: &str, same: &[u32], within, across| Placement {
            host: host.into(),
            same_node: same.to_vec(),
            links_same_node: within,
            links_other_nodes: across,
        };
        assert_eq!(placement(&plan, 0), expect("kt-node-node-a", &[1], 1, 1));
        assert_eq!(placement(&plan, 1), expect("kt-node-node-a", &[0], 1, 0));
        assert_eq!(placement(&plan, 2), expect("kt-node-node-b", &[3], 1, 1));
        assert_eq!(placement(&plan, 3), expect("kt-node-node-b", &[2], 1, 0));
        // NCCL plans its own rings: the nodes, not the links.
        plan.backend = BackendKind::Nccl;
        assert_eq!(placement(&plan, 2), expect("kt-node-node-b", &[3], 0, 0));
    }

    /// Over TCP: ranks on two nodes get every byte down the node-aware
    /// tree.
    #[test]
    fn a_broadcast_by_node_reaches_every_rank() {
        let len = 5 << 20; // more than one piece
        let on = ["node-a", "node-b", "node-a", "node-b", "node-b"];
        let results = on_every_rank(
            5,
            |plan| {
                for (r, n) in on.iter().enumerate() {
                    plan.ranks[r].node = n.to_string();
                }
            },
            Duration::from_secs(20),
            |r, _, _, mut c| {
                let mut buf = HostBuf(vec![0; len]);
                if r == 0 {
                    for (i, x) in buf.0.iter_mut().enumerate() {
                        *x = (i % 253) as u8;
                    }
                }
                c.broadcast(0, &[0, 1, 2, 3, 4], &mut buf, 0, len as u64)
                    .unwrap();
                buf.0
            },
        );
        for (r, buf) in results.iter().enumerate() {
            assert!(
                buf.iter().enumerate().all(|(i, x)| *x == (i % 253) as u8),
                "rank {r} got other bytes"
            );
        }
    }

    #[test]
    fn a_rank_that_never_comes_is_a_timeout_naming_it() {
        let b = HostBackend::new("/dev/shm");
        let e0 = b.endpoint("t", "127.0.0.1").unwrap();
        let e1 = b.endpoint("t", "127.0.0.1").unwrap();
        let plan = plan_of(2, 2, &[e0.address(), e1.address()]);
        // Connecting makes every connection the plan needs: a rank that
        // never comes fails it, within the timeout.
        let Err(e) = b.connect(&plan, 0, e0, None, Device::Cpu, Duration::from_millis(300)) else {
            panic!("connected without rank 1");
        };
        assert!(matches!(e, TransportError::Timeout(_)), "{e}");
        assert!(e.to_string().contains("rank 1 (pod-1"), "{e}");
    }

    #[test]
    fn a_connection_that_says_nothing_does_not_hold_up_the_peers() {
        let b = HostBackend::new("/dev/shm");
        let e0 = b.endpoint("t", "127.0.0.1").unwrap();
        let e1 = b.endpoint("t", "127.0.0.1").unwrap();
        let plan = plan_of(2, 2, &[e0.address(), e1.address()]);
        // Silent, and first in the listener's queue.
        let _silent = TcpStream::connect(e0.address()).unwrap();
        let timeout = Duration::from_secs(2);
        std::thread::scope(|s| {
            let (b, plan) = (&b, &plan);
            let h = s.spawn(move || b.connect(plan, 1, e1, None, Device::Cpu, timeout).map(drop));
            // Before hellos had threads of their own, rank 1's waited
            // behind the silent one until rank 0's timeout.
            b.connect(plan, 0, e0, None, Device::Cpu, timeout)
                .map(drop)
                .unwrap();
            h.join().unwrap().unwrap();
        });
    }

    /// A member of the quorum knows the plan (the transfer id, every
    /// endpoint): its hello claiming another rank, from its own IP, is
    /// closed, and the rank's own connection is then taken and gets the
    /// flow.
    #[test]
    fn a_hello_from_another_ip_than_the_ranks_is_refused() {
        let b = HostBackend::new("/dev/shm");
        let e0 = b.endpoint("t", "127.0.0.1").unwrap();
        let e1 = b.endpoint("t", "127.0.0.1").unwrap();
        let plan = plan_of(2, 2, &[e0.address(), e1.address()]);
        // From 127.0.0.2 (the loopback too, but not rank 1's 127.0.0.1),
        // first in rank 0's queue.
        let impostor =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        impostor
            .bind(&SocketAddr::from(([127, 0, 0, 2], 0)).into())
            .unwrap();
        let to: SocketAddr = e0.address().parse().unwrap();
        impostor.connect(&to.into()).unwrap();
        let impostor = TcpStream::from(impostor);
        (&impostor).write_all(&hello(&plan.id, 1)).unwrap();
        let timeout = Duration::from_secs(20);
        std::thread::scope(|s| {
            let (b, plan) = (&b, &plan);
            let root = s.spawn(move || {
                let mut c = b.connect(plan, 0, e0, None, Device::Cpu, timeout).unwrap();
                let mut buf = HostBuf(vec![9; 16]);
                c.broadcast(0, &[0, 1], &mut buf, 0, 16).unwrap();
            });
            // Owned here, so that a failed assertion closes it and ends
            // rank 0's wait on it.
            let mut impostor = impostor;
            impostor.set_read_timeout(Some(timeout)).unwrap();
            let mut byte = [0u8; 1];
            let read = impostor.read(&mut byte);
            assert!(
                matches!(read, Ok(0)),
                "rank 0 did not close the impostor's connection: {read:?}"
            );
            let mut c = b.connect(plan, 1, e1, None, Device::Cpu, timeout).unwrap();
            let mut buf = HostBuf(vec![0; 16]);
            c.broadcast(0, &[0, 1], &mut buf, 0, 16).unwrap();
            assert_eq!(buf.0, [9; 16]);
            root.join().unwrap();
        });
    }

    #[test]
    fn a_peer_dying_mid_broadcast_is_an_error_not_a_hang() {
        let b = HostBackend::new("/dev/shm");
        let e0 = b.endpoint("t", "127.0.0.1").unwrap();
        let e1 = b.endpoint("t", "127.0.0.1").unwrap();
        let plan = plan_of(2, 2, &[e0.address(), e1.address()]);
        let err = std::thread::scope(|s| {
            let plan2 = plan.clone();
            let b2 = b.clone();
            s.spawn(move || {
                // Rank 1 connects, reads the header and a little, then dies.
                let mut c = b2
                    .connect(&plan2, 1, e1, None, Device::Cpu, Duration::from_secs(5))
                    .unwrap();
                let mut buf = HostBuf(vec![0; 16]);
                // Expects 16 bytes where 64 MiB come: ranks disagree.
                let e = c.broadcast(0, &[0, 1], &mut buf, 0, 16).unwrap_err();
                assert!(e.to_string().contains("disagree"), "{e}");
            });
            let mut c = b
                .connect(&plan, 0, e0, None, Device::Cpu, Duration::from_secs(5))
                .unwrap();
            let mut buf = HostBuf(vec![7; 64 << 20]);
            c.broadcast(0, &[0, 1], &mut buf, 0, 64 << 20).unwrap_err()
        });
        assert!(
            matches!(err, TransportError::Peer(_) | TransportError::Io { .. }),
            "{err}"
        );
    }
}
