import subprocess, sys
s = subprocess.run(["git", "show", "HEAD:captioning/models/layers.py"], capture_output=True, text=True, check=True).stdout
old='''            k, v = self.project_kv(key)
            if cache is not None:
                if kind == "self" and "k" in cache:
                    k = torch.cat([cache["k"], k], dim=2)
                    v = k if self.share == "kv" else torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
'''
new='''            k, v = self.project_kv(key)
            if static_cache.is_static(cache):  # preallocated positions, written in place (see static_cache)
                k = static_cache.write(cache, "k", k, 2)
                v = k if self.share == "kv" else static_cache.write(cache, "v", v, 2)
            elif cache is not None:
                if kind == "self" and "k" in cache:
                    k = torch.cat([cache["k"], k], dim=2)
                    v = k if self.share == "kv" else torch.cat([cache["v"], v], dim=2)
                cache["k"], cache["v"] = k, v
'''
if s.count(old) != 1: sys.exit("cache block not found in HEAD")
s = s.replace(old, new)
old = "from torch import nn\n"
s = s.replace(old, old + "\nfrom captioning.models import static_cache\n", 1)
sys.stdout.write(s)
