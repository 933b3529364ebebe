//! The user's own `pg_hba.conf` lines (`spec.pgHba`) and what makes one acceptable.
//!
//! PostgreSQL refuses to start when a single line of `pg_hba.conf` cannot be read
//! (and a reload keeps the old rules, so the fault waits for the next restart). So a
//! line Castellan writes must be one PostgreSQL loads on every build it runs, and it
//! must not reach what Castellan owns: the local socket, the replication role, the
//! `replication` pseudo-database, and the superuser (whose network login is
//! `spec.enableSuperuserAccess`). One pattern says it; admission's CEL rule matches
//! with the same pattern, and the instance manager checks again with [`rule_problem`],
//! which also parses the IPv6 ranges the pattern can only shape.
//!
//! What is accepted, deliberately narrow (what every PostgreSQL build loads):
//! - types `host`, `hostssl`, `hostnossl` (no `local`: the socket is Castellan's; no
//!   `hostgssenc`, which a build without GSSAPI refuses to load; no `include`);
//! - database and user lists of plain names separated by commas (a user may be a
//!   `+group`); no quotes, no `@file`, no `/regex`;
//! - an address: an IPv4 or IPv6 range in CIDR form, an IPv4 address and mask, or a
//!   host name (`all`, `samehost`, `samenet`, `.example.com`, `db.example.com`); a
//!   bare IP address without a mask is refused, as PostgreSQL would;
//! - a method: `scram-sha-256` or `md5` (optionally `clientcert=verify-ca|verify-full`
//!   on `hostssl`), `cert` (on `hostssl` only, optionally `clientname=CN|DN`), or
//!   `reject`. `trust` would let anyone in without a password and `password` sends it
//!   in clear; `ldap`, `radius`, `pam`, `gss` depend on how PostgreSQL was built.

use std::sync::LazyLock;

use regex::Regex;

/// The roles and the database a user's line may not name: the superuser (network
/// login is `spec.enableSuperuserAccess`), Castellan's replication role, and the
/// `replication` pseudo-database.
pub const RESERVED_USERS: [&str; 2] = ["postgres", "streaming_replica"];

/// The longest line accepted (it bounds CEL's cost estimate too).
pub const MAX_RULE_LENGTH: usize = 256;

/// The most lines accepted.
pub const MAX_RULES: usize = 64;

const SPACE: &str = "[ ]+";
const NAME: &str = "[A-Za-z0-9_][A-Za-z0-9_.$-]*";
const USER: &str = "[+]?[A-Za-z0-9_][A-Za-z0-9_.$-]*";
const OCTET: &str = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])";

/// What a line must look like, in the syntax both Rust's `regex` and CEL's RE2 read
/// (no backslashes: CEL string literals would need them doubled). Fields are separated
/// by spaces (not tabs), so that admission can split a line into its fields.
pub static RULE_PATTERN: LazyLock<String> = LazyLock::new(|| {
    let ipv4 = format!("{OCTET}([.]{OCTET}){{3}}");
    let ipv4_cidr = format!("{ipv4}/(3[0-2]|[12]?[0-9])");
    let ipv6_cidr = "[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*/(12[0-8]|1[01][0-9]|[1-9]?[0-9])";
    // The last label starts with a letter, so that a bare IP address is no host name.
    let host = "[.]?([A-Za-z0-9-]+[.])*[A-Za-z][A-Za-z0-9-]*";
    let address = format!("({ipv4_cidr}|{ipv6_cidr}|{ipv4}{SPACE}{ipv4}|{host})");
    let body = format!("{NAME}(,{NAME})*{SPACE}{USER}(,{USER})*{SPACE}{address}{SPACE}");
    let password = "(scram-sha-256|md5)";
    format!(
        "^(hostssl{SPACE}{body}({password}({SPACE}clientcert=verify-(ca|full))?|cert({SPACE}clientname=(CN|DN))?|reject)\
         |(host|hostnossl){SPACE}{body}({password}|reject))[ ]*$"
    )
});

/// Lines naming the `replication` database or a reserved role, as a pattern: the
/// database and user fields are the second and third.
pub static RESERVED_PATTERN: LazyLock<String> = LazyLock::new(|| {
    let users = RESERVED_USERS.join("|");
    format!(
        "^[a-z]+{SPACE}([^ ]*,)?replication(,[^ ]*)?[ ]\
         |^[a-z]+{SPACE}[^ ]+{SPACE}([^ ]*,)?[+]?({users})(,[^ ]*)?[ ]"
    )
});

/// The CEL rule that an IPv6 range in the address field (the fourth) is one: the form
/// pattern only shapes it.
pub const IPV6_RULE: &str = "!self.matches('^[a-z]+[ ]+[^ ]+[ ]+[^ ]+[ ]+[^ ]*:') || isCIDR(self.split(' ').filter(f, f != '')[3])";

/// The message for an IPv6 range that is none.
pub const IPV6_MESSAGE: &str = "the address of a pgHba line is not a valid IPv6 range in CIDR form";

/// The message admission and the instance give for a line of the wrong form.
pub const FORM_MESSAGE: &str = "each pgHba line must be 'host|hostssl|hostnossl DATABASES USERS ADDRESS METHOD' with plain comma-separated names, an address in CIDR form, an IPv4 address and mask, or a host name (all, samehost, samenet, .example.com), and a method scram-sha-256 or md5 (clientcert=verify-ca|verify-full on hostssl), cert (hostssl only, clientname=CN|DN) or reject: trust, password, local lines, includes and comments are refused";

/// The message for a line that names what Castellan owns.
pub const RESERVED_MESSAGE: &str = "pgHba lines cannot name the replication database or the roles postgres and streaming_replica: replication is Castellan's, and the superuser's network login is spec.enableSuperuserAccess";

/// Why `line` cannot go into `pg_hba.conf`, if it cannot.
pub fn rule_problem(line: &str) -> Option<String> {
    static RULE: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(&RULE_PATTERN).expect("a valid pattern"));
    static RESERVED: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(&RESERVED_PATTERN).expect("a valid pattern"));
    if line.len() > MAX_RULE_LENGTH {
        return Some(format!(
            "pgHba line {line:?} is longer than {MAX_RULE_LENGTH} characters"
        ));
    }
    if !RULE.is_match(line) {
        return Some(format!("pgHba line {line:?}: {FORM_MESSAGE}"));
    }
    if RESERVED.is_match(line) {
        return Some(format!("pgHba line {line:?}: {RESERVED_MESSAGE}"));
    }
    // The pattern shapes an IPv6 range; whether it is one only a parser can say.
    let address = line.split_whitespace().nth(3).unwrap_or_default();
    if let Some((ip, _)) = address.split_once('/')
        && ip.contains(':')
        && ip.parse::<std::net::Ipv6Addr>().is_err()
    {
        return Some(format!("pgHba line {line:?}: {IPV6_MESSAGE}"));
    }
    None
}

/// The problems of every line, in order.
pub fn rules_problems(lines: &[String]) -> Vec<String> {
    let mut problems: Vec<String> = lines.iter().filter_map(|l| rule_problem(l)).collect();
    if lines.len() > MAX_RULES {
        problems.push(format!("pgHba holds more than {MAX_RULES} lines"));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_postgresql_loads_everywhere_are_accepted() {
        for line in [
            "hostssl all all 10.0.0.0/8 scram-sha-256",
            "host shop clerk 192.168.1.0/24 md5",
            "hostnossl all all 0.0.0.0/0 reject",
            "hostssl shop,audit +readers,clerk .example.com scram-sha-256",
            "hostssl all clerk 10.1.2.3 255.255.255.255 cert clientname=DN",
            "hostssl all all fd00::/8 scram-sha-256 clientcert=verify-full",
            "hostssl all all all cert",
            "host app_db report-user db.example.com scram-sha-256  ",
        ] {
            assert_eq!(rule_problem(line), None, "{line}");
        }
    }

    #[test]
    fn lines_that_would_not_load_or_would_open_the_door_are_refused() {
        for line in [
            // Methods: no password, clear text, or build-dependent.
            "host all all 0.0.0.0/0 trust",
            "hostssl all all 0.0.0.0/0 password",
            "host all all 0.0.0.0/0 ldap ldapserver=x",
            // cert and clientcert need TLS.
            "host all all 0.0.0.0/0 cert",
            "host all all 0.0.0.0/0 scram-sha-256 clientcert=verify-full",
            // Not a host line: the socket, an include, a comment, GSSAPI.
            "local all all trust",
            "include /etc/passwd",
            "# a comment",
            "hostgssenc all all 0.0.0.0/0 scram-sha-256",
            // Addresses PostgreSQL refuses: a bare IP, a mask past 32, a bad octet.
            "host all all 10.0.0.1 scram-sha-256",
            "host all all 10.0.0.0/33 scram-sha-256",
            "host all all 300.0.0.0/8 scram-sha-256",
            "host all all fd00:::1::/8 scram-sha-256",
            // Files and quoting.
            "host all @users 0.0.0.0/0 scram-sha-256",
            "host \"all\" all 0.0.0.0/0 scram-sha-256",
            // Two lines in one, or a trailing comment.
            "host all all 0.0.0.0/0 reject\nhost all all 0.0.0.0/0 trust",
            "host all all 0.0.0.0/0 reject # no",
            // Tabs (admission splits fields at spaces).
            "host\tall\tall\tsamenet\treject",
            // Too few fields.
            "host all all scram-sha-256",
            "",
        ] {
            assert!(rule_problem(line).is_some(), "{line:?} was accepted");
        }
    }

    #[test]
    fn castellans_roles_and_replication_are_refused_by_name() {
        for line in [
            "hostssl replication all 0.0.0.0/0 scram-sha-256",
            "hostssl shop,replication all 0.0.0.0/0 scram-sha-256",
            "hostssl all postgres 0.0.0.0/0 scram-sha-256",
            "hostssl all clerk,streaming_replica 0.0.0.0/0 cert",
            "hostssl all +postgres 0.0.0.0/0 scram-sha-256",
        ] {
            let problem = rule_problem(line).unwrap_or_default();
            assert!(
                problem.contains("enableSuperuserAccess"),
                "{line}: {problem}"
            );
        }
        // Names that only contain them are someone else's.
        for line in [
            "hostssl replication_log all 0.0.0.0/0 scram-sha-256",
            "hostssl all postgres_reader 0.0.0.0/0 scram-sha-256",
        ] {
            assert_eq!(rule_problem(line), None, "{line}");
        }
    }

    #[test]
    fn too_many_lines_are_refused() {
        let lines = vec!["hostssl all all all reject".to_owned(); MAX_RULES + 1];
        assert_eq!(rules_problems(&lines).len(), 1);
        assert!(rules_problems(&lines[..MAX_RULES]).is_empty());
    }
}
