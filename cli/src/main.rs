//! `sluice`: checks, explains and documents a filter configuration with the filter's own code
//! (sluice-core), and prints the configuration's JSON Schema.

mod config;
mod docs;
mod explain;
mod text;
mod top;

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

const ABOUT: &str = "Checks, explains and documents a sluice filter configuration.

FILE is the filter's JSON configuration: the plugin `configuration` value of the Wasm filter in \
Envoy, as a JSON file (not an Envoy YAML). `-` reads it from standard input.

Exit status: 0 when done, 1 when the configuration is invalid (the message, on standard error, \
is the one the filter logs), 2 for a usage error or a file that cannot be read.";

#[derive(Parser)]
#[command(name = "sluice", version, about = ABOUT, long_about = ABOUT)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Validates a configuration as the filter does and prints a one-line summary.
    ///
    /// Invalid: prints the filter's own message (the field and what is wrong) on standard error
    /// and exits with 1.
    Check {
        /// The filter's JSON configuration, not an Envoy YAML (`-`: standard input).
        file: PathBuf,
    },
    /// Explains what the configuration does with one request: which rules apply, the keys they
    /// count, their limits; and whether the request is bypassed.
    Explain {
        /// The filter's JSON configuration, not an Envoy YAML (`-`: standard input).
        file: PathBuf,
        #[command(flatten)]
        request: explain::RequestArgs,
        /// Prints the explanation as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Prints the rate limits per endpoint and tier as a Markdown table, for an API's
    /// documentation.
    Docs {
        /// The filter's JSON configuration, not an Envoy YAML (`-`: standard input).
        file: PathBuf,
    },
    /// Prints the JSON Schema (draft-07) of the configuration, for editors.
    Schema,
    /// Shows the keys a rule admits and denies most across the fleet, as the counter service
    /// merged the proxies' reports (rules with `top_keys`), refreshed as `top` does.
    ///
    /// The service answers with an admin token; its message, when it refuses, is printed on
    /// standard error and the exit status is 1.
    Top(top::TopArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let output = match run(cli.command) {
        Ok(output) => output,
        Err(Failure::Invalid(message)) => {
            eprintln!("{message}");
            return ExitCode::from(1);
        }
        Err(Failure::Unreadable(message)) => {
            eprintln!("sluice: {message}");
            return ExitCode::from(2);
        }
        Err(Failure::Service(message)) => {
            eprintln!("sluice: {message}");
            return ExitCode::from(1);
        }
    };
    let mut stdout = std::io::stdout().lock();
    // A closed pipe (`sluice docs x.json | head`) is not an error worth a panic.
    let _ = stdout
        .write_all(output.as_bytes())
        .and_then(|()| stdout.flush());
    ExitCode::SUCCESS
}

/// Why a command printed nothing on standard output.
enum Failure {
    /// The configuration is invalid: the filter's message.
    Invalid(String),
    /// The file could not be read.
    Unreadable(String),
    /// The counter service could not be reached, or refused (`sluice top`).
    Service(String),
}

fn run(command: Command) -> Result<String, Failure> {
    match command {
        Command::Check { file } => {
            let loaded = config::load(&file)?;
            Ok(format!("{}\n", config::summary(&loaded.policy)))
        }
        Command::Explain {
            file,
            request,
            json,
        } => {
            let loaded = config::load(&file)?;
            let explanation = explain::explain(&loaded, &request);
            if json {
                let mut out = serde_json::to_string_pretty(&explanation)
                    .expect("an explanation is plain data");
                out.push('\n');
                Ok(out)
            } else {
                Ok(explain::render(&explanation))
            }
        }
        Command::Docs { file } => {
            let loaded = config::load(&file)?;
            Ok(docs::markdown(&loaded))
        }
        Command::Schema => Ok(schema()),
        Command::Top(args) => top::run(&args),
    }
}

/// The schema as `schema/sluice.schema.json` holds it.
fn schema() -> String {
    let mut out = serde_json::to_string_pretty(&sluice_core::config::schema())
        .expect("a schema is plain JSON");
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }
}
