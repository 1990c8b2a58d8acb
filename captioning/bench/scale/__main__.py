"""``python -m captioning.bench.scale SPEC``: one measured stage in this fresh process
(:func:`captioning.bench.scale.measure.child`); its result as JSON on the last line of stdout."""

import json
import sys

from captioning.bench.scale.measure import child

if __name__ == "__main__":  # a measured child process
    print(json.dumps(child(json.loads(sys.argv[1])), default=str))
