"""docs/architecture.md's layout table names every source folder there is."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def _layout_names() -> set[str]:
    layout = ARCHITECTURE.split("## Layout", 1)[1].split("\n## ", 1)[0]
    first_cells = re.findall(r"^\| ([^|]*) \|", layout, re.M)
    return {name.rstrip("/") for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}


def test_layout_names_every_package_of_autodeploy_and_every_top_level_folder():
    names = _layout_names()
    packages = [f"autodeploy/{d.name}" for d in sorted((ROOT / "autodeploy").iterdir()) if d.is_dir() and not d.name.startswith(("_", "."))]
    # What installs and builds leave beside the sources (.gitignore's folders) is not the project's layout.
    made = {"build", "dist", "out"}
    folders = [
        d.name
        for d in sorted(ROOT.iterdir())
        if d.is_dir() and not d.name.startswith((".", "_")) and d.name != "autodeploy" and d.name not in made and not d.name.endswith(".egg-info")
    ]
    assert not [p for p in packages + folders if p not in names]
