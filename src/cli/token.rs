//! Where `agq` takes its bearer token from, and the warning about a token
//! on the command line.
//!
//! Sources, in the order of precedence:
//!
//! 1. the command line: `--token-file PATH` or `--token TOKEN` (both
//!    together is a usage error, refused when the flags are parsed);
//! 2. the environment: `AGQ_TOKEN_FILE` or `AGQ_TOKEN` (both set, with
//!    neither flag given, is an error: which one was meant is unknown).
//!
//! A token file is read as `agw` reads its own (`src/worker/config.rs`):
//! the whole file, surrounding whitespace trimmed; an unreadable or empty
//! file is an error that names the file and never its contents. `--token`
//! given on the command line still works but prints [`COMMAND_LINE_WARNING`]
//! on stderr: every local user can read a process's command line (`ps`,
//! `/proc/PID/cmdline`) and shells keep it in their history. An empty
//! `AGQ_TOKEN`, `AGQ_TOKEN_FILE` or `--token` counts as not given.

use std::{io::Write, path::Path};

use super::{CliError, ClientOptions};

/// The line `agq` prints on stderr when `--token` is given on the command
/// line (not through `AGQ_TOKEN`).
pub const COMMAND_LINE_WARNING: &str = "agq: warning: --token on the command line is visible to \
     other local users (ps, /proc) and kept in shell history; use --token-file FILE or AGQ_TOKEN \
     instead";

/// The bearer token `opts` selects, if any, with the warning to print
/// first when it came from `--token` on the command line.
///
/// # Errors
///
/// [`CliError::Input`] when `--token` and `--token-file` are both on the
/// command line, when `AGQ_TOKEN` and `AGQ_TOKEN_FILE` are both set
/// without either flag, or when the token file cannot be read or is empty.
pub fn select(opts: &ClientOptions) -> Result<(Option<String>, Option<&'static str>), CliError> {
    let token = opts.token.as_deref().filter(|t| !t.is_empty());
    let file = opts
        .token_file
        .as_deref()
        .filter(|p| !p.as_os_str().is_empty() || opts.token_file_on_command_line);
    let from_flag = |t: &str| {
        let warning = opts.token_on_command_line.then_some(COMMAND_LINE_WARNING);
        (Some(t.to_owned()), warning)
    };
    match (token, file) {
        (None, None) => Ok((None, None)),
        (Some(t), None) => Ok(from_flag(t)),
        (None, Some(path)) => Ok((Some(read(path, opts.token_file_on_command_line)?), None)),
        (Some(t), Some(path)) => {
            match (opts.token_on_command_line, opts.token_file_on_command_line) {
                (true, true) => Err(CliError::Input(CONFLICT.into())),
                // A flag overrides the environment.
                (true, false) => Ok(from_flag(t)),
                (false, true) => Ok((Some(read(path, true)?), None)),
                (false, false) => Err(CliError::Input(
                    "AGQ_TOKEN and AGQ_TOKEN_FILE are both set: unset one of them (or pass \
                 --token-file FILE, which overrides both)"
                        .into(),
                )),
            }
        }
    }
}

/// [`select`], printing its warning on stderr.
///
/// # Errors
///
/// As [`select`].
pub fn resolve(opts: &ClientOptions) -> Result<Option<String>, CliError> {
    let (token, warning) = select(opts)?;
    if let Some(w) = warning {
        // Not eprintln!: a closed stderr must not stop the command.
        let _ = writeln!(std::io::stderr(), "{w}");
    }
    Ok(token)
}

/// The usage error for `--token` together with `--token-file`.
pub const CONFLICT: &str = "the argument '--token <TOKEN>' cannot be used with \
     '--token-file <PATH>': pass only --token-file (or AGQ_TOKEN)";

/// The token in `path`: the whole file, trimmed. `flag` says whether the
/// path came from `--token-file` (else from `AGQ_TOKEN_FILE`), for the
/// message. Errors name the file, never what it holds.
fn read(path: &Path, flag: bool) -> Result<String, CliError> {
    let name = if flag {
        format!("--token-file {}", path.display())
    } else {
        format!("AGQ_TOKEN_FILE {}", path.display())
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Input(format!("cannot read {name}: {e}")))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(CliError::Input(format!(
            "{name} is empty: it must hold the bearer token"
        )));
    }
    Ok(token.to_owned())
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    const SECRET: &str = "secret-token-0123456789";

    fn opts(token: Option<(&str, bool)>, file: Option<(PathBuf, bool)>) -> ClientOptions {
        let mut o = ClientOptions::plain("http://127.0.0.1:1");
        if let Some((t, cl)) = token {
            o.token = Some(t.to_owned());
            o.token_on_command_line = cl;
        }
        if let Some((f, cl)) = file {
            o.token_file = Some(f);
            o.token_file_on_command_line = cl;
        }
        o
    }

    fn token_file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    fn err(o: &ClientOptions) -> String {
        select(o).expect_err("an error").to_string()
    }

    #[test]
    fn no_source_no_token() {
        assert_eq!(select(&opts(None, None)).unwrap(), (None, None));
        assert_eq!(select(&opts(Some(("", true)), None)).unwrap(), (None, None));
        let empty_env = opts(None, Some((PathBuf::new(), false)));
        assert_eq!(select(&empty_env).unwrap(), (None, None));
    }

    #[test]
    fn a_token_on_the_command_line_warns_and_the_environment_does_not() {
        let (t, w) = select(&opts(Some((SECRET, true)), None)).unwrap();
        assert_eq!(t.as_deref(), Some(SECRET));
        assert_eq!(w, Some(COMMAND_LINE_WARNING));
        assert!(!COMMAND_LINE_WARNING.contains('\n'));
        let (t, w) = select(&opts(Some((SECRET, false)), None)).unwrap();
        assert_eq!(t.as_deref(), Some(SECRET));
        assert_eq!(w, None);
    }

    #[test]
    fn a_token_file_is_read_and_trimmed() {
        let (_d, path) = token_file(&format!("\n  {SECRET}\r\n\n"));
        for cl in [true, false] {
            let (t, w) = select(&opts(None, Some((path.clone(), cl)))).unwrap();
            assert_eq!(t.as_deref(), Some(SECRET));
            assert_eq!(w, None);
        }
    }

    #[test]
    fn an_unreadable_or_empty_file_names_the_file_not_the_token() {
        let (dir, empty) = token_file(" \n\t\n");
        let e = err(&opts(None, Some((empty.clone(), true))));
        assert_eq!(
            e,
            format!(
                "--token-file {} is empty: it must hold the bearer token",
                empty.display()
            )
        );
        let e = err(&opts(None, Some((empty.clone(), false))));
        assert!(
            e.starts_with(&format!("AGQ_TOKEN_FILE {} is empty", empty.display())),
            "{e}"
        );

        let missing = dir.path().join("missing");
        let e = err(&opts(None, Some((missing.clone(), true))));
        assert!(
            e.starts_with(&format!("cannot read --token-file {}: ", missing.display())),
            "{e}"
        );
        // Not UTF-8: the error says so without quoting the bytes.
        let binary = dir.path().join("binary");
        std::fs::write(&binary, b"secret-\xff-token").unwrap();
        let e = err(&opts(None, Some((binary.clone(), true))));
        assert!(
            e.starts_with(&format!("cannot read --token-file {}", binary.display())),
            "{e}"
        );
        assert!(!e.contains("secret"), "{e}");
        // A directory.
        let e = err(&opts(None, Some((dir.path().to_owned(), true))));
        assert!(e.contains(&dir.path().display().to_string()), "{e}");
    }

    #[test]
    fn the_command_line_overrides_the_environment_and_two_flags_conflict() {
        let (_d, path) = token_file("from-the-file-0123456789");
        let both_flags = opts(Some((SECRET, true)), Some((path.clone(), true)));
        assert_eq!(err(&both_flags), CONFLICT);
        let both_env = opts(Some((SECRET, false)), Some((path.clone(), false)));
        assert!(err(&both_env).starts_with("AGQ_TOKEN and AGQ_TOKEN_FILE are both set"));
        // --token-file beats AGQ_TOKEN, silently.
        let (t, w) = select(&opts(Some((SECRET, false)), Some((path.clone(), true)))).unwrap();
        assert_eq!((t.as_deref(), w), (Some("from-the-file-0123456789"), None));
        // --token beats AGQ_TOKEN_FILE, with the warning.
        let (t, w) = select(&opts(Some((SECRET, true)), Some((path, false)))).unwrap();
        assert_eq!(
            (t.as_deref(), w),
            (Some(SECRET), Some(COMMAND_LINE_WARNING))
        );
    }
}
