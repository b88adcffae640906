# scripts run by hand (they print counts, they take minutes): never collected by the suite
collect_ignore_glob = ["*.py"]
