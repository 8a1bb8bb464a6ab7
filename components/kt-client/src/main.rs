//! `kt`: put/get/ls/rm from the command line.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
