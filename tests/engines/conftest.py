"""The engines' tests, in folders mirroring engines/ (tests/engines/rollout/ for engines/rollout/, ...; a module of
engines/ itself: a test here). No fixtures: this file puts tests/engines/ on sys.path (pytest's rootdir-less
`prepend` import mode adds a conftest's folder), so a test in any sub-folder imports the helpers shared across
them by name (`plan_check`)."""
