"""Pipeline presets and model configs (installed as autodeploy.configs)."""
