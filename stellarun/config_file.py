"""``stellarun --config-file FILE``: horovodrun's configuration file.

The file is YAML as horovodrun reads it: sections of ``key: value`` lines, e.g.::

    params:
      fusion_threshold_mb: 32
      cycle_time_ms: 1
      cache_capacity: 1024
    timeline:
      filename: /tmp/timeline.json
      mark_cycles: true
    stall_check:
      enabled: true
      warning_time_seconds: 60
      shutdown_time_seconds: 0
    logging:
      level: INFO

JSON with the same shape is accepted too. Only that subset of YAML is read (sections one level
deep, scalars: numbers, true/false, strings, optionally quoted), so no YAML library is needed; a
line that does not fit, an unknown section or key is a usage error naming it. Settings given on
the command line win over the file's. Each setting becomes the option of the same name
(``--fusion-threshold-mb`` ...), which sets the HOROVOD_* variable stella_mpi reads.
"""
import json

# section -> key -> the argparse destination it sets
KEYS = {
    "params": {"fusion_threshold_mb": "fusion_threshold_mb", "cycle_time_ms": "cycle_time_ms",
               "cache_capacity": "cache_capacity",
               # stella_mpi's reductions are always hierarchical (clusters, then the WAN)
               "hierarchical_allreduce": None, "hierarchical_allgather": None},
    "timeline": {"filename": "timeline_filename", "mark_cycles": "timeline_mark_cycles"},
    "stall_check": {"enabled": "stall_check", "warning_time_seconds": "stall_check_warning_time_seconds",
                    "shutdown_time_seconds": "stall_check_shutdown_time_seconds"},
    "logging": {"level": "log_level", "hide_timestamp": None},
    "library_options": {"gloo_timeout_seconds": "timeout"},
}


class ConfigFileError(ValueError):
    pass


def _scalar(text):
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("null", "~", ""):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _strip_comment(raw):
    """The line without its comment: from a ``#`` at the start or after a space, outside quotes."""
    quote = None
    for i, ch in enumerate(raw):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or raw[i - 1] in " \t"):
            return raw[:i].rstrip()
    return raw.rstrip()


def parse_yaml_subset(text, path="<config>"):
    """{section: {key: value}} (and top-level scalars) from the YAML subset described above."""
    out, section = {}, None
    for n, raw in enumerate(text.splitlines(), 1):
        line = _strip_comment(raw)
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if "\t" in line[:indent + 1]:
            raise ConfigFileError("%s:%d: tabs are not allowed in indentation" % (path, n))
        key, sep, value = line.strip().partition(":")
        if not sep or not key:
            raise ConfigFileError("%s:%d: expected 'key: value', got %r" % (path, n, raw.strip()))
        key = key.strip()
        if indent == 0:
            if value.strip():
                out[key] = _scalar(value)
                section = None
            else:
                section = out.setdefault(key, {})
        else:
            if section is None:
                raise ConfigFileError("%s:%d: %r is indented but belongs to no section" % (path, n, key))
            section[key] = _scalar(value)
    return out


# argparse destination -> (type, what it must be)
TYPES = {"fusion_threshold_mb": (float, "a number of MiB"), "cycle_time_ms": (float, "a number of ms"),
         "cache_capacity": (int, "a whole number"), "timeline_filename": (str, "a path"),
         "timeline_mark_cycles": (bool, "true or false"), "stall_check": (bool, "true or false"),
         "stall_check_warning_time_seconds": (float, "a number of seconds"),
         "stall_check_shutdown_time_seconds": (float, "a number of seconds"),
         "log_level": (str, "one of TRACE, DEBUG, INFO, WARNING, ERROR, FATAL"),
         "timeout": (float, "a number of seconds")}
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")


def _checked(path, key, dest, value):
    cast, what = TYPES[dest]
    ok = isinstance(value, bool) if cast is bool else (
        isinstance(value, str) if cast is str else
        isinstance(value, (int, float)) and not isinstance(value, bool) and (cast is float or isinstance(value, int)))
    if dest == "log_level" and ok:
        ok = value.upper() in LOG_LEVELS
    if not ok or (cast in (int, float) and value < 0):
        raise ConfigFileError("%s: %s must be %s, not %r" % (path, key, what, value))
    return value


def load(path):
    """The settings of ``path`` as {argparse destination: value}."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigFileError("cannot read the config file %s: %s" % (path, e)) from None
    data = json.loads(text) if text.lstrip().startswith("{") else parse_yaml_subset(text, path)
    if not isinstance(data, dict):
        raise ConfigFileError("%s: expected sections of settings" % path)
    settings = {}
    for name, body in data.items():
        if name not in KEYS:
            raise ConfigFileError("%s: unknown section %r (known: %s)" % (path, name, ", ".join(sorted(KEYS))))
        if not isinstance(body, dict):
            raise ConfigFileError("%s: section %r must hold 'key: value' lines" % (path, name))
        for key, value in body.items():
            if key not in KEYS[name]:
                raise ConfigFileError("%s: unknown setting %s.%s (known: %s)"
                                      % (path, name, key, ", ".join(sorted(KEYS[name]))))
            dest = KEYS[name][key]
            if dest is not None:
                settings[dest] = _checked(path, "%s.%s" % (name, key), dest, value)
    return settings
