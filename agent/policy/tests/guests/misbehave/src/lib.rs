//! A policy that misbehaves on request, for the policy host's tests. It implements
//! all three hooks (so it also shows that one component can), and picks its
//! behaviour from its `mode` parameter, or else from the request id (which it asks
//! the host for, `host::request_id`):
//!
//! - `trap`: panics (a wasm trap);
//! - `loop`: never returns (the deadline must stop it);
//! - `hog`: allocates until memory runs out (the memory cap must stop it);
//! - `reserve`: asks for 1 GiB, takes the refusal in its stride and answers normally;
//! - `chatty`: writes 1,000 log lines, then answers normally;
//! - `slow:<ms>`: busy-waits that long on the host's clock, then answers normally;
//! - `invalid`: answers something the host must refuse;
//! - `jitter`: retries after a random delay below one second;
//! - `reach`: tries to read the environment, the file system and the network, and
//!   gives up with a report of what it got (the host grants none of them);
//! - `ids`: gives up with the call's ids as the host reports them;
//! - `leak`: takes a new handle to stderr from the host (`wasi:cli/stderr`) and
//!   never drops it, then answers normally (the host's table grows per call);
//! - anything else: answers normally — retry after `delay_ms` (param, default 1),
//!   the candidates in reverse order, admit.

use std::hint::black_box;

use outrigger_policy_sdk::{
    BudgetDecision, BudgetPolicy, BudgetRequest, CallContext, Failure, FallbackPolicy,
    FallbackRequest, RetryDecision, RetryPolicy, host,
};

/// The misbehaving policy.
pub struct Misbehave;

enum Mode {
    Normal,
    Invalid,
    Jitter,
    Reach,
    Ids,
}

/// What a policy that reaches for the outside world gets: `env:none`, `fs:denied`,
/// `net:denied` under the host.
fn reach() -> String {
    let vars = std::env::vars().count();
    let env = if vars == 0 {
        "env:none".to_string()
    } else {
        format!("env:{vars}")
    };
    let fs = match (std::fs::read_dir("/"), std::fs::read_dir(".")) {
        (Err(_), Err(_)) => "fs:denied",
        _ => "fs:open",
    };
    let net = match std::net::TcpStream::connect("127.0.0.1:7") {
        Ok(_) => "net:open",
        Err(_) => "net:denied",
    };
    format!("{env} {fs} {net}")
}

fn act() -> Mode {
    let mode = host::param("mode").unwrap_or_else(host::request_id);
    match mode.as_str() {
        "trap" => panic!("deliberate trap"),
        "loop" => loop {
            black_box(&mode);
        },
        "hog" => {
            let mut hoard: Vec<Vec<u8>> = Vec::new();
            loop {
                hoard.push(black_box(vec![1u8; 1 << 20]));
            }
        }
        "reserve" => {
            let mut wish: Vec<u8> = Vec::new();
            let refused = wish.try_reserve(1 << 30).is_err();
            black_box(refused);
            Mode::Normal
        }
        "chatty" => {
            for n in 0..1_000 {
                host::log(host::Level::Info, &format!("line {n}"));
            }
            Mode::Normal
        }
        "invalid" => Mode::Invalid,
        "jitter" => Mode::Jitter,
        "reach" => Mode::Reach,
        "ids" => Mode::Ids,
        "leak" => {
            leak_a_handle();
            Mode::Normal
        }
        other => {
            if let Some(ms) = other
                .strip_prefix("slow:")
                .and_then(|ms| ms.parse::<u64>().ok())
            {
                let start = host::now();
                while (host::now() - start).as_millis() < u128::from(ms) {
                    black_box(ms);
                }
            }
            Mode::Normal
        }
    }
}

#[cfg(target_family = "wasm")]
#[expect(
    unsafe_code,
    reason = "a raw import, to hold a host resource without ever dropping it"
)]
mod raw {
    #[link(wasm_import_module = "wasi:cli/stderr@0.2.0")]
    unsafe extern "C" {
        /// Returns a new `output-stream` handle, owned by the caller.
        #[link_name = "get-stderr"]
        pub fn get_stderr() -> i32;
    }

    pub fn leak_a_handle() {
        // SAFETY: the import takes nothing and returns a handle index; dropping
        // the index (never the handle) is what this mode is for.
        let handle = unsafe { get_stderr() };
        std::hint::black_box(handle);
    }
}

#[cfg(target_family = "wasm")]
use raw::leak_a_handle;

#[cfg(not(target_family = "wasm"))]
fn leak_a_handle() {}

impl RetryPolicy for Misbehave {
    fn decide(_ctx: CallContext, _failure: Failure) -> RetryDecision {
        match act() {
            Mode::Invalid => RetryDecision::RetryAfter(u64::MAX),
            Mode::Jitter => RetryDecision::RetryAfter(host::random_up_to(999)),
            Mode::Reach => RetryDecision::give_up(reach()),
            Mode::Ids => RetryDecision::give_up(format!(
                "task={:?} request={}",
                host::task_id(),
                host::request_id()
            )),
            Mode::Normal => RetryDecision::RetryAfter(host::param_or("delay_ms", 1)),
        }
    }
}

impl FallbackPolicy for Misbehave {
    fn order(request: FallbackRequest) -> Vec<u32> {
        match act() {
            Mode::Invalid => vec![u32::try_from(request.candidates.len()).unwrap_or(u32::MAX)],
            Mode::Jitter | Mode::Reach | Mode::Ids | Mode::Normal => {
                let mut order: Vec<u32> = Vec::new();
                let mut names: Vec<&str> = Vec::new();
                for (i, candidate) in request.candidates.iter().enumerate().rev() {
                    if let (false, Ok(i)) =
                        (names.contains(&candidate.name.as_str()), u32::try_from(i))
                    {
                        order.push(i);
                        names.push(&candidate.name);
                    }
                }
                order
            }
        }
    }
}

impl BudgetPolicy for Misbehave {
    fn admit(_request: BudgetRequest) -> BudgetDecision {
        match act() {
            Mode::Invalid => BudgetDecision::downgrade("a-model-nobody-offered"),
            Mode::Jitter | Mode::Reach | Mode::Ids | Mode::Normal => BudgetDecision::Admit,
        }
    }
}

outrigger_policy_sdk::export_policy!(Misbehave);
