//! Quorums of GPU broadcasts: who takes part in one coordinated tensor
//! transfer, and the plan they all run. In memory only (see *Restarts*).
//!
//! `round` is the pure state machine of rounds and plans (the clock passed
//! in, its own [`QuorumError`]); `coordinator` keeps the open rounds and the
//! transfers ([`Quorums`]) and runs the waits on them; `routes` is the HTTP
//! around it, and the one place a [`QuorumError`] becomes an `ApiError`.
//!
//! # Rounds
//!
//! - `POST /api/v1/quorums/{group}/join` ([`QuorumJoin`]) is long-polled: it
//!   is answered when the group's open *round* closes, with the member's
//!   rank and the plan ([`QuorumPlan`]), or with this member's error.
//! - A *member* is a process of a pod: its agent's id and the member id the
//!   agent gives it ([`QuorumJoin::member`]: the client's pid, with the
//!   label the client gave when it gave one). Several processes of a pod
//!   each take a rank of their own; what is per pod (the agent, its shared
//!   memory) they share, and on NCCL each rank builds its own communicator
//!   on its own GPU (the agent runs one transfer per rank).
//! - A group has at most one open round. Its first join opens it and fixes
//!   its settings from that join's window and backend (world size, timeout,
//!   ips, fanout, pack, bucket size); the timeout runs from that first join.
//!   Later joins' windows are checked, then ignored.
//! - Refused at once, the round unchanged: bad input (400 `invalid_request`:
//!   group id, agent id, ips, world size under 2, timeout not in (0, 3600] s,
//!   fanout 0, bucket under [`t::MIN_BUCKET_BYTES`], no keys, a key twice,
//!   invalid tensor layouts, a `window.group_id` naming another group, a
//!   bad member id, a putter's key with `from`, a getter's `from` asking for
//!   no putter, ranks not ascending, or a reduction its dtypes lack: bool,
//!   8-bit floats, an integer mean); a member on another backend than the
//!   round's (400); a member already in the round (409 `conflict`: one rank
//!   per process); a putter of a key another member of the round puts with
//!   another layout (400, naming both); a new round beyond [`MAX_OPEN`] open
//!   rounds plus kept transfers (503 `unavailable`); a join past a
//!   [`JoinLimits`] (503 `unavailable`, naming it): its agent's open joins
//!   ([`JoinLimits::PER_AGENT`]), the server's (three quarters of its
//!   in-flight request slots: each open join is a long poll holding one, so
//!   the other calls keep the rest), or the bytes all open joins hold
//!   ([`JoinLimits::BYTES`]).
//! - A join body is at most [`MAX_JOIN_BODY`] (413 `payload_too_large`,
//!   refused before it is read), and is read against the metadata server's
//!   body budget (`kt_service::BodyBudget`), so bodies being read hold a
//!   bounded amount of memory however many come at once.
//! - A member whose request goes away before the close (the client
//!   disconnected: axum drops the handler's future) leaves the round; a round
//!   whose members all left is forgotten.
//! - A round closes on whichever comes first: `world_size` members; every IP
//!   of `ips` among the members' IPs; the timeout. [`QuorumPlan::closed_by`]
//!   says which (`world_size`, `ips`, `timeout`).
//!
//! # Plans
//!
//! Closing takes the round out of the open ones (a later join opens a new
//! round), then builds the plan (`plan`, pure) without holding the
//! coordinator's lock, keeps the transfer, and only then answers the
//! members, all with the same shared plan:
//! - no putter: every member gets 503 `no_source`;
//! - a getter wanting a key no putter brings gets 404 `not_found`; a plain
//!   getter (no `from`) of a key several putters put gets 409 `conflict`
//!   naming the putters and telling it to ask for every putter's tensors or
//!   a reduction; one asking for every putter's (`all`) whose count is not
//!   the key's putters', or for a rank (`by_rank`) that does not put the
//!   key, gets 400; one whose
//!   destination layout does not match the source's
//!   ([`t::check_destination`]) gets 400 `invalid_request` naming both
//!   sides; one whose token may not read a key it wants (the service of
//!   each putter's key is looked up when the putter joins, and a getter
//!   whose token reads only some services is refused a key whose service
//!   is unknown) gets 403 `forbidden`; none of them takes a rank, so no
//!   member ever sends it anything;
//! - ranks: the putters ordered by their first key (rank 0 puts the
//!   smallest), then pod, then member id; then the remaining getters
//!   ordered by pod, then member id: the same members make the same plan
//!   whatever order they joined in;
//! - flows: for each putter, each of its keys in order: root the putter,
//!   receivers the getters that want the key from it (ascending; a
//!   `by_rank` getter only from the ranks it named), the putter's tensors
//!   and version; a key nobody wants makes no flow (its putter still takes
//!   a rank). A key of several putters is so one flow per putter, in rank
//!   order: a getter of `all` receives them into its sets in that order,
//!   one of a reduction (`sum`, `mean`) adds them up as they arrive (in its
//!   agent, `kt_tensor::reduce`);
//! - no getter left: every remaining member gets 503 `unavailable`;
//! - the plan's id is a fresh UUID; backend, fanout and packing come from the
//!   round. A plan failing [`TransferPlan::validate`] is a bug: 500 to all.
//!
//! # Transfers
//!
//! The closed round becomes a *transfer*, `/api/v1/quorums/{group}/{id}`
//! (unknown group or id: 404):
//! - `PUT …/rendezvous` ([`Rendezvous`], 1 byte to 64 KiB): the backend's
//!   bootstrap blob (NCCL's unique id), published by rank 0. Once: the same
//!   blob again is accepted, another one is 409.
//! - `GET …/rendezvous?wait_ms=N` (default 30 000, at most 600 000):
//!   long-polled until published, else 503 `unavailable`.
//! - `POST …/done` ([`QuorumDone`]) → [`QuorumStatus`]: once per rank (a
//!   second report is 409, a rank outside the plan 400).
//! - `GET …?wait_ms=N` (default 0, at most 600 000) → [`QuorumStatus`],
//!   long-polled until every rank reported or N ms.
//! - `GET /api/v1/quorums/{group}` → [`QuorumInfo`]: the open round (its
//!   members) and the kept transfers (404 when it has neither).
//!
//! A join after the close opens a new round (the previous transfer stays
//! queryable). Transfers are forgotten [`KEEP_COMPLETE`] after every rank
//! reported, or [`KEEP_CLOSED`] after the close if some never do (swept
//! lazily, at most once a second, on access).
//!
//! # Restarts
//!
//! Nothing here is persisted. A metadata-server restart fails open rounds:
//! on shutdown their joins are answered 503 (or their connections break) and
//! the members' agents report an error to their applications, which may
//! join again. Transfers in flight keep running between the agents (the
//! plan and the rendezvous are all they need from here), but their `done`
//! reports and status are 404 after the restart. A restarted server never
//! answers a stale plan.
//!
//! Waits use `tokio::sync::watch` (no polling): one channel per round (its
//! close), and per transfer (its rendezvous, its reports). A round's timeout
//! is driven by its members' own requests, so no task outlives them.
//!
//! [`QuorumJoin`]: kt_types::tensor::QuorumJoin
//! [`QuorumJoin::member`]: kt_types::tensor::QuorumJoin::member
//! [`QuorumPlan`]: kt_types::tensor::QuorumPlan
//! [`QuorumPlan::closed_by`]: kt_types::tensor::QuorumPlan::closed_by
//! [`t::MIN_BUCKET_BYTES`]: kt_types::tensor::MIN_BUCKET_BYTES
//! [`t::check_destination`]: kt_types::tensor::check_destination
//! [`TransferPlan::validate`]: kt_types::tensor::TransferPlan::validate
//! [`Rendezvous`]: kt_types::tensor::Rendezvous
//! [`QuorumDone`]: kt_types::tensor::QuorumDone
//! [`QuorumStatus`]: kt_types::tensor::QuorumStatus
//! [`QuorumInfo`]: kt_types::tensor::QuorumInfo

mod coordinator;
#[cfg(test)]
mod fixtures;
mod round;
mod routes;

pub use coordinator::{
    JoinLimits, KEEP_CLOSED, KEEP_COMPLETE, MAX_BLOB_LEN, MAX_OPEN, QuorumCounts, Quorums,
};
pub use round::{Access, ClosedBy, MAX_TIMEOUT_SECS, QuorumError};
pub use routes::{DEFAULT_WAIT_MS, MAX_JOIN_BODY, MAX_WAIT_MS, routes};
