"""turbotrain inside trainers it does not drive: Hugging Face ``Trainer`` (:mod:`.hf`), Lightning
(:mod:`.lightning`), Accelerate (:mod:`.accelerate`); the recipe they share (:mod:`.recipe`) and the
monitoring behind their callbacks (:mod:`.observer`). Nothing here is imported by ``import turbotrain``:
each module imports its framework, an optional extra."""
