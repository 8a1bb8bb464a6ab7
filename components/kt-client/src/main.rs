//! `kt`: put/get/ls/rm from the command line.

mod cli;
#[cfg(feature = "kube")]
mod dataset_cli;
#[cfg(feature = "kube")]
use kt_client::external;
mod tensor_cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
