"""Make a new venv see the torch of the interpreter running this script (`make ... TORCH=system`).

    python3 scripts/system_torch_pth.py .venv-system/bin/python

`python -m venv --system-site-packages` exposes the *base* interpreter's site-packages. On GPU
images the python that has torch is often itself a venv (e.g. /opt/torch/.venv/bin/python3), whose
packages a venv made from it would not see. A .pth file in the new venv naming the folder that
holds torch fixes both cases; pip then sees that torch as installed and does not fetch another.
"""
import os
import subprocess
import sys

import torch

site_dir = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))
venv_python = sys.argv[1]
if subprocess.run([venv_python, "-c", "import torch"], capture_output=True).returncode == 0:
    print(f"{venv_python} already sees torch")
    sys.exit(0)
purelib = subprocess.run([venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
with open(os.path.join(purelib, "_system_torch.pth"), "w") as f:
    f.write(site_dir + "\n")
print(f"{venv_python} now sees torch {torch.__version__} from {site_dir}")
