//! `{{name}}` templating of task arguments.
//!
//! Every `{{name}}` in an argument is replaced by the job input's value for
//! `name` (surrounding whitespace inside the braces is ignored, so
//! `{{ file }}` works too). Substitution happens once, left to right: a value
//! that itself contains `{{…}}` is inserted verbatim. A `{{` without a closing
//! `}}`, and an empty `{{}}`, are left literal. A name the input does not
//! have is an error that names it, so the job fails before anything runs.
//!
//! Input values are data, not options: a value that would begin an
//! argument with `-` (the placeholder starts the argument and the value
//! starts with `-`) is refused, so `sort {{file}}` with `file=-o/etc/x`
//! fails before anything runs instead of writing a file. A task allows it
//! with `allow_option_values`, and an argument after a literal `--`
//! argument (the end of options for most tools) is never an option, so
//! values there are not checked.

use std::collections::HashMap;

/// A `{{name}}` placeholder the job input has no value for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("job input has no value for template variable \"{{{{{name}}}}}\"")]
pub struct MissingVariable {
    /// The variable name found between the braces (trimmed).
    pub name: String,
}

/// Renders one argument, replacing every `{{name}}` by `input[name]`.
///
/// # Errors
///
/// [`MissingVariable`] naming the first placeholder that `input` has no
/// value for.
pub fn render(arg: &str, input: &HashMap<String, String>) -> Result<String, MissingVariable> {
    let mut out = String::with_capacity(arg.len());
    let mut rest = arg;
    while let Some(open) = rest.find("{{") {
        let after_open = &rest[open + 2..];
        let Some(close) = after_open.find("}}") else {
            // No closing braces anywhere after this point: the rest is literal.
            break;
        };
        let name = after_open[..close].trim();
        if name.is_empty() {
            // `{{}}` is not a placeholder; keep it literally.
            out.push_str(&rest[..open + 2 + close + 2]);
        } else {
            let value = input.get(name).ok_or_else(|| MissingVariable {
                name: name.to_owned(),
            })?;
            out.push_str(&rest[..open]);
            out.push_str(value);
        }
        rest = &after_open[close + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Renders every argument of a task with [`render`].
///
/// # Errors
///
/// [`MissingVariable`] for the first argument that names a variable the
/// input lacks.
pub fn render_all(
    args: &[String],
    input: &HashMap<String, String>,
) -> Result<Vec<String>, MissingVariable> {
    args.iter().map(|a| render(a, input)).collect()
}

/// Why a task's arguments cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    /// A placeholder without a value.
    #[error(transparent)]
    Missing(#[from] MissingVariable),
    /// A value that would be read as an option.
    #[error(
        "input value for \"{{{{{name}}}}}\" starts with '-' and would be read as an option \
         (argument {position}); input values are data: the task must set allow_option_values \
         or put the placeholder after a \"--\" argument"
    )]
    OptionValue {
        /// The variable name.
        name: String,
        /// 1-based argument position.
        position: usize,
    },
}

/// Renders a task's arguments like [`render_all`], and refuses an input
/// value that would begin an argument with `-` unless `allow_option_values`
/// is set or a literal `--` argument came before it.
///
/// # Errors
///
/// [`TemplateError::Missing`] for a placeholder without a value,
/// [`TemplateError::OptionValue`] for a value read as an option.
pub fn render_args(
    args: &[String],
    input: &HashMap<String, String>,
    allow_option_values: bool,
) -> Result<Vec<String>, TemplateError> {
    let mut after_double_dash = false;
    let mut out = Vec::with_capacity(args.len());
    for (i, arg) in args.iter().enumerate() {
        let rendered = render(arg, input)?;
        if !allow_option_values && !after_double_dash && rendered.starts_with('-') {
            if let Some(name) = leading_placeholder(arg) {
                return Err(TemplateError::OptionValue {
                    name: name.to_owned(),
                    position: i + 1,
                });
            }
        }
        if arg == "--" {
            after_double_dash = true;
        }
        out.push(rendered);
    }
    Ok(out)
}

/// The name of the placeholder that starts `arg` (`{{name}}…`), if any.
/// When an argument starts with a placeholder and renders to `-…`, the
/// dash came from an input value (this one's, or a later one's when this
/// value is empty), never from the plan.
fn leading_placeholder(arg: &str) -> Option<&str> {
    let rest = arg.strip_prefix("{{")?;
    let close = rest.find("}}")?;
    let name = rest[..close].trim();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn replaces_variables() {
        let i = input(&[("file", "/tmp/a.txt"), ("n", "3")]);
        assert_eq!(render("{{file}}", &i).unwrap(), "/tmp/a.txt");
        assert_eq!(render("-n{{n}}x{{ n }}", &i).unwrap(), "-n3x3");
        assert_eq!(render("no vars", &i).unwrap(), "no vars");
        assert_eq!(render("", &i).unwrap(), "");
    }

    #[test]
    fn missing_variable_is_named() {
        let err = render("--in={{file}}", &input(&[])).unwrap_err();
        assert_eq!(err.name, "file");
        assert_eq!(
            err.to_string(),
            "job input has no value for template variable \"{{file}}\""
        );
    }

    #[test]
    fn unclosed_and_empty_braces_are_literal() {
        let i = input(&[("a", "A")]);
        assert_eq!(render("{{a", &i).unwrap(), "{{a");
        assert_eq!(render("{{a}} and {{b", &i).unwrap(), "A and {{b");
        assert_eq!(render("{{}}{{a}}", &i).unwrap(), "{{}}A");
        assert_eq!(render("}}{{a}}}}", &i).unwrap(), "}}A}}");
    }

    #[test]
    fn values_are_not_expanded_again() {
        let i = input(&[("a", "{{b}}"), ("b", "B")]);
        assert_eq!(render("{{a}}", &i).unwrap(), "{{b}}");
    }

    #[test]
    fn render_all_stops_at_first_missing() {
        let i = input(&[("a", "A")]);
        let args = vec!["{{a}}".to_owned(), "{{zz}}".to_owned()];
        assert_eq!(render_all(&args, &i).unwrap_err().name, "zz");
        assert_eq!(render_all(&args[..1], &i).unwrap(), vec!["A".to_owned()]);
    }

    #[test]
    fn values_are_not_options() {
        let i = input(&[("file", "-o/etc/x"), ("dash", "-"), ("ok", "a.txt")]);
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let err = render_args(&args(&["-r", "{{file}}"]), &i, false).unwrap_err();
        assert_eq!(
            err,
            TemplateError::OptionValue {
                name: "file".into(),
                position: 2
            }
        );
        assert!(err.to_string().contains("allow_option_values"));
        // Allowed by the task, after `--`, or not at the start of an argument.
        assert!(render_args(&args(&["{{file}}"]), &i, true).is_ok());
        assert_eq!(
            render_args(&args(&["-r", "--", "{{file}}"]), &i, false).unwrap(),
            args(&["-r", "--", "-o/etc/x"])
        );
        assert!(render_args(&args(&["--in={{file}}"]), &i, false).is_ok());
        assert!(render_args(&args(&["{{ok}}", "-n"]), &i, false).is_ok());
        // A lone "-" (stdin for many tools) is an option-like value too.
        assert!(render_args(&args(&["{{dash}}"]), &i, false).is_err());
        // Missing values are still reported as such.
        assert!(matches!(
            render_args(&args(&["{{nope}}"]), &i, false),
            Err(TemplateError::Missing(_))
        ));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Rendering never panics; an argument without `{{` is unchanged;
            /// a value inserted is never re-expanded.
            #[test]
            fn render_is_total_and_literal(
                arg in "\\PC{0,40}",
                values in prop::collection::hash_map("[a-z]{1,4}", "\\PC{0,10}", 0..4),
            ) {
                let r = render(&arg, &values);
                if !arg.contains("{{") {
                    prop_assert_eq!(r, Ok(arg.clone()));
                }
            }

            /// `{{name}}` is replaced by exactly its value, whatever the value holds.
            #[test]
            fn placeholders_take_the_value_verbatim(
                prefix in "[^{}]{0,8}",
                suffix in "[^{}]{0,8}",
                value in "\\PC{0,16}",
            ) {
                let input = HashMap::from([("file".to_string(), value.clone())]);
                let arg = format!("{prefix}{{{{file}}}}{suffix}");
                prop_assert_eq!(render(&arg, &input), Ok(format!("{prefix}{value}{suffix}")));
            }
        }
    }
}
