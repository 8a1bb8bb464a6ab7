//! The faults a testbed can suffer, as one type: the runner's fault steps
//! (`kill`, `restart`, `link`, a node's `kill`) build a [`Fault`] for each
//! component they hit, the chaos soak ([`crate::chaos`]) picks faults at
//! random, and both apply them with [`Fault::inject`]. A new kind of fault
//! is a variant here, its injection below, and the step or the soak's menu
//! entry that makes it.

use std::fmt;

use crate::format::Signal;
use crate::target::{Component, Target, TargetError};

/// What a fault hits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hit {
    /// A server, or a pod with its commands and its agent.
    Component(Component),
    /// A pod's node agent alone (its commands, such as tensor holders,
    /// live on).
    Agent(String),
}

impl Hit {
    /// What starts again after a restart of it.
    pub fn component(&self) -> Component {
        match self {
            Hit::Component(c) => c.clone(),
            Hit::Agent(p) => Component::Pod(p.clone()),
        }
    }

    /// Its kind in a word: `metadata`, `store`, `pod` or `agent`.
    pub fn kind(&self) -> &'static str {
        match self {
            Hit::Component(Component::Metadata) => "metadata",
            Hit::Component(Component::Store) => "store",
            Hit::Component(Component::Pod(_)) => "pod",
            Hit::Agent(_) => "agent",
        }
    }
}

impl fmt::Display for Hit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hit::Component(c) => c.fmt(f),
            Hit::Agent(p) => write!(f, "the agent of pod {p}"),
        }
    }
}

/// One fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Signals it: KILL or TERM end it (it stays down), STOP freezes it
    /// (it neither answers nor resets), CONT thaws it.
    Signal(Hit, Signal),
    /// Ends it with the signal and starts it again (same state, address
    /// and port); done once it is ready.
    Restart(Hit, Signal),
    /// Cuts (`false`) or restores (`true`) a component's network link.
    Link(Component, bool),
    /// A node of the topology's `nodes` is lost: its node-cache agent dies
    /// and the API marks it NotReady.
    LoseNode(String),
}

impl Fault {
    /// Applies it to `target`.
    pub async fn inject(&self, target: &dyn Target) -> Result<(), TargetError> {
        match self {
            Fault::Signal(hit, sig) => signal(target, hit, *sig).await,
            Fault::Restart(hit, sig) => {
                signal(target, hit, *sig).await?;
                target.start(&hit.component()).await
            }
            Fault::Link(c, up) => target.set_link(c, *up).await,
            Fault::LoseNode(node) => target.kill_node(node).await,
        }
    }

    /// The fault that ends this one when it lasts a while: a freeze's
    /// thaw, a cut link's restore; None for the others.
    pub fn undo(&self) -> Option<Fault> {
        match self {
            Fault::Signal(hit, Signal::STOP) => Some(Fault::Signal(hit.clone(), Signal::CONT)),
            Fault::Link(c, false) => Some(Fault::Link(c.clone(), true)),
            _ => None,
        }
    }

    /// What it hits, as an error names it (`store`, `pod a-1`, `the agent
    /// of pod a`, `node node-2`).
    pub fn hits(&self) -> String {
        match self {
            Fault::Signal(hit, _) | Fault::Restart(hit, _) => hit.to_string(),
            Fault::Link(c, _) => c.to_string(),
            Fault::LoseNode(node) => node.clone(),
        }
    }

    /// Its kind, as the chaos report counts faults: `store KILL+start`,
    /// `agent STOP`, `link cut`, ... (the component's kind, not its name).
    pub fn kind(&self) -> String {
        match self {
            Fault::Signal(hit, sig) => format!("{} {}", hit.kind(), sig.name()),
            Fault::Restart(hit, sig) => format!("{} {}+start", hit.kind(), sig.name()),
            Fault::Link(_, false) => "link cut".to_owned(),
            Fault::Link(_, true) => "link restore".to_owned(),
            Fault::LoseNode(_) => "node lost".to_owned(),
        }
    }
}

async fn signal(target: &dyn Target, hit: &Hit, sig: Signal) -> Result<(), TargetError> {
    match hit {
        Hit::Component(c) => target.kill(c, sig).await,
        Hit::Agent(pod) => target.kill_agent(pod, sig).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freezes_and_cuts_are_undone_the_rest_are_not() {
        let store = Hit::Component(Component::Store);
        assert_eq!(
            Fault::Signal(store.clone(), Signal::STOP).undo(),
            Some(Fault::Signal(store.clone(), Signal::CONT))
        );
        assert_eq!(
            Fault::Link(Component::Store, false).undo(),
            Some(Fault::Link(Component::Store, true))
        );
        assert_eq!(Fault::Signal(store.clone(), Signal::KILL).undo(), None);
        assert_eq!(Fault::Restart(store, Signal::TERM).undo(), None);
    }

    #[test]
    fn kinds_and_what_is_hit() {
        let agent = Fault::Restart(Hit::Agent("a-1".into()), Signal::KILL);
        assert_eq!(agent.kind(), "agent KILL+start");
        assert_eq!(agent.hits(), "the agent of pod a-1");
        let frozen = Fault::Signal(Hit::Component(Component::Metadata), Signal::STOP);
        assert_eq!(frozen.kind(), "metadata STOP");
        let pod = Fault::Link(Component::Pod("b".into()), false);
        assert_eq!(
            (pod.kind().as_str(), pod.hits().as_str()),
            ("link cut", "pod b")
        );
    }
}
