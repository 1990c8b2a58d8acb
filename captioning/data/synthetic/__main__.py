"""``python -m captioning.data.synthetic OUT_DIR NUM_IMAGES [--seed S]``: write the synthetic dataset."""

from captioning.data.synthetic.dataset import main

if __name__ == "__main__":
    main()
