# Sourced by every script that builds or boots the VM lab (../shared/lab), so that they all ask
# for the same guest: the lab's own packages and Ceph's, for scripts/lab-rbd.sh (the guest runs
# scripts/ceph-dev-cluster.sh itself). A different list would rebuild the guest image.
export LAB_EXTRA_PKGS=${LAB_EXTRA_PKGS:-ceph-mon,ceph-osd,ceph-common,librbd-dev}
