"""The local stack `lorastream up` starts: store, worker and gateway as child processes."""
